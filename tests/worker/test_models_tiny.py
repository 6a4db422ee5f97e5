"""Tiny random-weight HF checkpoints, loaded by our loader, run through the paged cache, compared to HF.

Every model runs the same teacher-forced schedule over two sequences A (20-token prompt) and B
(13-token prompt), so each kind of batch is exercised and every step's logits have an HF twin:

    step 1: prefill A[0:12]        + prefill B[0:13]          two prefills, no prefix
    step 2: decode  B[13]          + prefill A[12:20]         decode and a chunk with a 12-token prefix
    step 3-7: decode A[20+i]       + decode  B[14+i]          batched decode, different lengths
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from worker.attention import AttentionMetadata, allocate_kv_cache
from worker.models.config import UnsupportedModelError, load_model_config
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import WeightMismatchError, load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 24
TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,  # logits of order 1: a wrong rotation or mask shows far above atol
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # wavelengths 6..~3000: all three llama3 bands are hit
}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}

MODELS: dict[str, Callable[[], transformers.PreTrainedConfig]] = {
    "llama-gqa-untied": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama-tied": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama3-rope": lambda: transformers.LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE),
    "llama-biases-linear-rope": lambda: transformers.LlamaConfig(
        **TINY, attention_bias=True, mlp_bias=True, rope_parameters=LINEAR_ROPE
    ),
    "qwen2-qkv-bias-yarn": lambda: transformers.Qwen2Config(
        **{**TINY, "num_key_value_heads": 1}, rope_parameters=YARN_ROPE
    ),
    "mistral-sliding-window": lambda: transformers.MistralConfig(
        **{**TINY, "num_key_value_heads": 4}, sliding_window=8
    ),
    # head_dim 12: no multiple of a vector (the fused CPU layer's per-head attention path)
    "llama-head-dim-12": lambda: transformers.LlamaConfig(**{**TINY, "hidden_size": 48}),
    # SmolLM2-135M's attention shape, 3 query heads of 64 a KV head, and Llama 3.2 1B's, 4 of 64 (the
    # fused CPU layer's attention compiled for them), the second with a sliding window
    "llama-group3-dim64": lambda: transformers.LlamaConfig(
        **{**TINY, "hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1}
    ),
    "mistral-group4-dim64-window": lambda: transformers.MistralConfig(
        **{**TINY, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1}, sliding_window=8
    ),
}
MODEL_CLASSES = {
    "LlamaConfig": transformers.LlamaForCausalLM,
    "Qwen2Config": transformers.Qwen2ForCausalLM,
    "MistralConfig": transformers.MistralForCausalLM,
}


def _save_hf(name: str, path: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = MODELS[name]()
    config._attn_implementation = "eager"
    model = MODEL_CLASSES[type(config).__name__](config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                # HF initialises biases to 0 and norms to 1; random values make wrong wiring visible
                param.copy_(torch.rand_like(param) + 0.5 if "norm" in param_name else torch.randn_like(param))
    model.save_pretrained(path)
    return model


class PagedSequences:
    """A minimal runner: shuffled (non-contiguous) blocks per sequence, one metadata per step."""

    def __init__(self, model: LlamaForCausalLM, tokens: dict[str, list[int]]) -> None:
        cfg = model.config
        self.model = model
        self.tokens = tokens
        self.kv_caches = allocate_kv_cache(
            cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu"
        )
        free = list(range(NUM_BLOCKS))
        random.Random(1).shuffle(free)
        self.tables = {
            name: [free.pop() for _ in range(-(-len(seq) // BLOCK_SIZE))] for name, seq in tokens.items()
        }

    def step(self, chunks: list[tuple[str, int, int]], num_decodes: int) -> torch.Tensor:
        """Run new tokens ``seq[start:end]`` for each chunk; return logits [T, V] of every new token."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc, seq_lens = [0], []
        for name, start, end in chunks:
            table = self.tables[name]
            input_ids += self.tokens[name][start:end]
            positions += range(start, end)
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + end - start)
            seq_lens.append(end)
        width = max(len(self.tables[name]) for name, _, _ in chunks)
        block_tables = torch.zeros(len(chunks), width, dtype=torch.int64)
        for row, (name, _, _) in enumerate(chunks):
            block_tables[row, : len(self.tables[name])] = torch.tensor(self.tables[name])
        meta = AttentionMetadata.build(
            slot_mapping=torch.tensor(slots),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            num_decodes=num_decodes,
            block_size=BLOCK_SIZE,
            sliding_window=self.model.config.sliding_window,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta)
            return self.model.compute_logits(hidden)


@pytest.mark.parametrize("name", list(MODELS))
def test_paged_model_matches_hf(name: str, tmp_path: Path) -> None:
    hf_model = _save_hf(name, tmp_path)
    model, config = load_model(tmp_path, torch.float32)
    assert config.tie_word_embeddings == bool(hf_model.config.tie_word_embeddings)

    gen = torch.Generator().manual_seed(2)
    tokens = {
        "A": torch.randint(0, 256, (25,), generator=gen).tolist(),
        "B": torch.randint(0, 256, (19,), generator=gen).tolist(),
    }
    with torch.no_grad():
        expected = {k: hf_model(torch.tensor([v])).logits[0] for k, v in tokens.items()}
    assert expected["A"].std() > 0.3, "logits too small for atol 1e-4 to mean anything"

    runner = PagedSequences(model, tokens)
    got = runner.step([("A", 0, 12), ("B", 0, 13)], num_decodes=0)
    torch.testing.assert_close(got[:12], expected["A"][:12], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[12:], expected["B"][:13], atol=1e-4, rtol=1e-4)

    got = runner.step([("B", 13, 14), ("A", 12, 20)], num_decodes=1)
    torch.testing.assert_close(got[0], expected["B"][13], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1:], expected["A"][12:20], atol=1e-4, rtol=1e-4)

    for i in range(5):
        got = runner.step([("A", 20 + i, 21 + i), ("B", 14 + i, 15 + i)], num_decodes=2)
        torch.testing.assert_close(got[0], expected["A"][20 + i], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[1], expected["B"][14 + i], atol=1e-4, rtol=1e-4)


def test_config_reads_transformers4_style(tmp_path: Path) -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rope_theta": 100000,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [0, 2],
        "bos_token_id": 1,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_model_config(tmp_path)
    assert config.head_dim == 64
    assert config.rope_theta == 100000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.eos_token_ids == (0, 2)
    assert config.torch_dtype == "bfloat16"
    assert config.tie_word_embeddings and not config.qkv_bias


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as info:
        load_model(tmp_path, torch.float32)
    assert "LlamaForCausalLM" in str(info.value)  # the message lists what is supported


@pytest.mark.parametrize("method", ["bitsandbytes", "fp8"])
def test_an_unsupported_quantization_method_is_refused_by_name(method: str, tmp_path: Path) -> None:
    _save_hf("llama-gqa-untied", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        UnsupportedModelError, match=f"quantization_config.quant_method = '{method}'.*gptq, awq"
    ):
        load_model(tmp_path, torch.float32)


def test_a_gptq_config_over_float_weights_names_the_packed_tensors(tmp_path: Path) -> None:
    """GPTQ / AWQ are served (tests/worker/test_hf_quant.py); float weights under one are a mismatch."""
    _save_hf("llama-gqa-untied", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.0\.self_attn\.q_proj\.qweight") as info:
        load_model(tmp_path, torch.float32)
    assert "model.layers.0.self_attn.q_proj.weight" in str(info.value)  # unexpected


def test_missing_and_unexpected_weights_are_named(tmp_path: Path) -> None:
    _save_hf("llama-gqa-untied", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(2)
    save_file(tensors, file)
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.1\.mlp\.up_proj\.weight") as info:
        load_model(tmp_path, torch.float32)
    assert "model.layers.1.mlp.extra_proj.weight" in str(info.value)


def test_misshapen_weight_is_named(tmp_path: Path) -> None:
    _save_hf("llama-gqa-untied", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, file)
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(tmp_path, torch.float32)
