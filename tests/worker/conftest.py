"""Fixtures of the worker's tests: a tiny random-weight Llama with SmolLM2's attention shape."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder: SmolLM2's attention shape (head_dim 64, three query heads to a KV head)
    at a size that runs in seconds, with the tiny tokenizer's vocabulary."""
    folder = tmp_path_factory.mktemp("tiny-engine")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / name, folder / name)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.2,  # logits of order 1: near-ties are rare, a wrong rotation is not hidden
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder
