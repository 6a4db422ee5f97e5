"""The C-kernel linears transform: greedy output unchanged, every linear swapped, skipped where it must."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from kernels.cpu.sampling import CpuSamplingOps
from kernels.sampling import TORCH_SAMPLING
from tests.worker.test_models_tiny import _save_hf
from wire.byte_tokenizer import ByteTokenizer
from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.cpu_isa import IsaLevel, caps_from_flags, probe
from worker.engine import Engine
from worker.model_runner import ModelRunner, build_model_runner, cpu_sampling
from worker.models.cpu_decode import CpuDecodeStep, fused_decode_step
from worker.models.cpu_linear import DecodeLinear, PanelEmbedding, PanelLinear, use_decode_linears
from worker.models.loader import load_model

pytestmark = pytest.mark.isa
AVX2 = {"avx", "avx2", "fma"}


def _engine(path: Path, cpu_kernels: bool) -> Engine:
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        device="cpu",  # the CPU kernels under test
        num_kv_blocks=64,
        block_size=8,
        max_num_seqs=8,
        cpu_kernels=cpu_kernels,
    )
    runner, model_config, num_blocks = build_model_runner(config, path)
    return Engine(config, ByteTokenizer(), runner, model_config, num_blocks)


@pytest.mark.parametrize(
    "name", ["llama-tied", "llama-gqa-untied", "qwen2-qkv-bias-yarn", "mistral-sliding-window"]
)
def test_greedy_output_is_unchanged_alone_and_batched(name: str, tmp_path: Path) -> None:
    _save_hf(name, tmp_path)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[3 + (i * 11 + j) % 200 for j in range(n)] for i, n in enumerate((2, 9, 17, 30, 5))]
    plain, fast = _engine(tmp_path, cpu_kernels=False), _engine(tmp_path, cpu_kernels=True)
    assert isinstance(fast.runner, ModelRunner)
    plain_model = plain.runner.model
    num_linears = sum(isinstance(m, nn.Linear) for m in plain_model.modules()) + (plain_model.lm_head is None)
    num_swapped = sum(isinstance(m, PanelLinear) for m in fast.runner.model.modules())
    assert num_swapped == (num_linears if probe().level >= IsaLevel.AVX2 else 0)
    # decode-only steps take the fused C layer (the prompts' lengths differ: mixed steps happen too)
    assert isinstance(fast.runner.decode_step, CpuDecodeStep) == (probe().level >= IsaLevel.AVX2)
    assert plain.runner.decode_step is None
    # the sampler's row operations: C on the fast engine, the torch references on the plain one
    assert isinstance(fast.runner.sampling, CpuSamplingOps) and plain.runner.sampling is TORCH_SAMPLING
    batched = [c.token_ids for c in fast.generate(prompts, params)]
    assert batched == [c.token_ids for c in plain.generate(prompts, params)]
    assert [fast.generate([p], params)[0].token_ids for p in prompts] == batched


def test_the_tied_embedding_and_lm_head_share_one_tensor(tmp_path: Path) -> None:
    _save_hf("llama-tied", tmp_path)
    model, _ = load_model(tmp_path, torch.float32)
    before = model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([[0, 5, before.shape[0] - 1], [47, 48, 49]])
    assert use_decode_linears(model, caps_from_flags(AVX2), tmp_path / "kernels") > 0
    assert isinstance(model.lm_head, PanelLinear) and isinstance(model.embed_tokens, PanelEmbedding)
    assert model.embed_tokens.lm_head is model.lm_head  # the packed matrix, once
    assert torch.equal(model.embed_tokens(ids), before[ids])  # rows across panel boundaries
    with pytest.raises(IndexError, match="expected values in"):
        model.embed_tokens(torch.tensor([1, before.shape[0]]))
    hidden = torch.randn(3, before.shape[1])
    torch.testing.assert_close(model.lm_head(hidden), hidden @ before.T, rtol=1e-5, atol=1e-5)
    assert model.lm_head.kernel.isa == "avx2"


def test_skipped_below_avx2_for_bf16_and_without_a_compiler(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save_hf("llama-tied", tmp_path)
    model, _ = load_model(tmp_path, torch.float32)
    with caplog.at_level(logging.INFO):
        assert use_decode_linears(model, caps_from_flags({"sse2"}), tmp_path) == 0
        assert "it needs AVX2, the CPU is default" in caplog.text
        monkeypatch.setenv("CC", "no-such-compiler")
        assert use_decode_linears(model, caps_from_flags(AVX2), tmp_path / "k") == 0
        assert "no C compiler" in caplog.text
    bf16, _ = load_model(tmp_path, torch.bfloat16)
    assert use_decode_linears(bf16, caps_from_flags(AVX2), tmp_path) == 0
    assert use_decode_linears(model, None, tmp_path) == 0
    assert not any(isinstance(m, DecodeLinear | PanelLinear) for m in model.modules())


def test_the_fused_decode_step_is_skipped_where_it_cannot_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save_hf("llama-tied", tmp_path)
    model, _ = load_model(tmp_path, torch.float32)
    bf16, _ = load_model(tmp_path, torch.bfloat16)
    with caplog.at_level(logging.INFO):
        assert fused_decode_step(model, [], caps_from_flags({"sse2"}), tmp_path) is None
        assert "no fused C layer: the kernel needs AVX2, the CPU is default" in caplog.text
        assert fused_decode_step(bf16, [], caps_from_flags(AVX2), tmp_path) is None
        assert "a bfloat16 model needs AVX512-BF16, the CPU is avx2" in caplog.text
        assert fused_decode_step(model.half(), [], caps_from_flags(AVX2), tmp_path) is None
        assert "not a float32 or bfloat16 model on CPU" in caplog.text
    assert fused_decode_step(model, [], None, tmp_path) is None


def test_sampling_is_torchs_without_a_compiler(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isinstance(cpu_sampling(tmp_path / "k"), CpuSamplingOps)
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.INFO):
        assert cpu_sampling(tmp_path / "other") is None
    assert "sampling: torch's row operations (no C kernel: no C compiler" in caplog.text
