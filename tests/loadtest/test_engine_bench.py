"""The engine benchmark's plumbing, on a tiny random-weight model so it runs in seconds.

The figures it prints are meaningless here; what is checked is that both sides produced
every requested token and the JSON carries the fields docs/benchmarks.md records.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from loadtest import engine_bench
from worker.models.store import pull_default_model

pytestmark = pytest.mark.slow  # borrows the embedded model's tokenizer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    source = pull_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_bench_prints_every_recorded_field(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = engine_bench.main(
        [
            "--model",
            str(tiny_model),
            "--dtype",
            "float32",
            "--num-requests",
            "6",
            "--prompt-range",
            "5",
            "40",
            "--output-range",
            "2",
            "12",
            "--hf-batch-size",
            "4",
            "--single-tokens",
            "8",
            "--cpu-kernels-baseline",
            "--json",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    for key in (
        "engine_tok_s",
        "hf_static_tok_s",
        "throughput_ratio",
        "engine_single_tok_s",
        "hf_single_tok_s",
        "single_ratio",
        "bandwidth_gb_s",
        "read_bandwidth_gb_s",
        "read_roofline_fraction",
        "roofline_single_tok_s",
        "roofline_fraction",
        "cpu_kernels_single_tok_s",
        "torch_matmuls_single_tok_s",
    ):
        assert result[key] > 0, key
    assert result["cpu_kernels_single_ratio"] == pytest.approx(
        result["cpu_kernels_single_tok_s"] / result["torch_matmuls_single_tok_s"], rel=0.01
    )
    assert result["dtype"] == "float32" and result["cpu"]
    assert result["throughput_ratio"] == pytest.approx(
        result["engine_tok_s"] / result["hf_static_tok_s"], rel=0.01
    )
    # Fractions are printed to 3 decimals: on this tiny model they are small, so allow the rounding.
    assert result["read_roofline_fraction"] == pytest.approx(
        result["roofline_fraction"] * result["bandwidth_gb_s"] / result["read_bandwidth_gb_s"],
        rel=0.01,
        abs=1e-3,
    )
    assert result["roofline_fraction"] == pytest.approx(
        result["engine_single_tok_s"] / result["roofline_single_tok_s"], rel=0.01, abs=1e-3
    )


def test_workload_is_seeded_and_in_range() -> None:
    a = engine_bench.make_workload(64, 1000, 3, (20, 1000), (16, 256))
    b = engine_bench.make_workload(64, 1000, 3, (20, 1000), (16, 256))
    assert a == b
    assert all(20 <= len(p) <= 1000 for p in a.prompts)
    assert all(16 <= n <= 256 for n in a.output_lens)
