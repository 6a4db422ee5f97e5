"""A GGUF model through the Triton kernels (weight-only quantized linears; Triton's interpreter on CPU,
compiled on a GPU when there is one): the engine's greedy tokens against the same file dequantized
to float (``models pull``) on the torch path, and the load-time layer check on that backend.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.triton_ops is first imported
pytest.importorskip("triton")

from tests.worker.test_gguf_model import greedy, write_quantized
from worker.config import EngineConfig
from worker.engine import Engine
from worker.model_runner import ModelRunner
from worker.models.gguf_convert import convert_gguf_to_hf
from worker.models.quant import QuantLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_engine_on_triton_matches_the_dequantized_file(kind: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TIERSERVE_CACHE", str(tmp_path / "cache"))
    path = write_quantized(tmp_path / "tiny.gguf", kind)
    convert_gguf_to_hf(path, tmp_path / "float", progress=lambda _: None)
    common = {"device": DEVICE, "kernel_backend": "triton", "dtype": "float32", "num_kv_blocks": 32}
    engine = Engine.from_config(EngineConfig(model=str(path), **common))  # type: ignore[arg-type]
    assert isinstance(engine.runner, ModelRunner)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert linears and all("Triton" in m.extra_repr() for m in linears)
    errors = engine.quant_layer_errors  # weight-only: x is not quantized, so the error is fp32 rounding
    assert len(errors) == len(linears) and max(errors.values()) < 1e-4
    reference = Engine.from_config(EngineConfig(model=str(tmp_path / "float"), **common))  # type: ignore[arg-type]
    prompts = [list(range(5, 17)), list(range(40, 47)), list(range(100, 103))]
    assert greedy(engine, prompts, batched=True) == greedy(reference, prompts, batched=True)
