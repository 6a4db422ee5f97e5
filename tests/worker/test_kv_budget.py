"""KV cache sizing: the arithmetic, the CPU default, and the warm-up forward the CUDA measurement runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.worker.test_models_tiny import TINY
from worker.attention import KernelBackend, make_attention_backend
from worker.config import EngineConfig
from worker.kv_budget import CPU_KV_CACHE_GB, GIB, kv_budget_bytes, kv_cache_blocks, warm_up_forward
from worker.model_runner import build_model_runner
from worker.models.loader import load_model


def test_the_budget_is_the_utilization_share_less_what_is_in_use() -> None:
    total = 80 * GIB
    assert kv_budget_bytes(total, 20 * GIB, 0.9) == 52 * GIB  # 72 GiB allowed, 20 in use
    assert kv_budget_bytes(total, 0, 1.0) == total
    assert kv_budget_bytes(1000, 100, 0.5) == 400  # rounds down to whole bytes


@pytest.mark.parametrize(("used_gib", "utilization"), [(72, 0.9), (75, 0.9), (1, 0.001)])
def test_no_room_left_names_the_figures_and_the_keys(used_gib: int, utilization: float) -> None:
    with pytest.raises(ValueError) as info:
        kv_budget_bytes(80 * GIB, used_gib * GIB, utilization)
    message = str(info.value)
    assert f"{utilization} of 80.00 GiB leaves no room" in message
    assert f"{used_gib:.2f} GiB are in use" in message and "kv_cache_gb" in message


def test_utilization_outside_zero_to_one_is_refused() -> None:
    for bad in (0.0, -0.5, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization: must be in"):
            kv_budget_bytes(GIB, 0, bad)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-kv")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(path)
    return path


def _bytes_per_block(config: EngineConfig) -> int:
    # TINY: 2 layers, 2 KV heads of 16, float32: K and V
    return 2 * 2 * config.block_size * 2 * 16 * 4


def test_cpu_without_kv_cache_gb_keeps_one_gib_and_an_explicit_size_wins(tiny: Path) -> None:
    base = EngineConfig(model=str(tiny), dtype="float32", device="cpu", cpu_kernels=False)
    _, _, num_blocks = build_model_runner(base, tiny)
    assert num_blocks == int(CPU_KV_CACHE_GB * GIB) // _bytes_per_block(base)
    config = EngineConfig(model=str(tiny), dtype="float32", device="cpu", cpu_kernels=False, kv_cache_gb=0.01)
    _, _, num_blocks = build_model_runner(config, tiny)
    assert num_blocks == int(0.01 * GIB) // _bytes_per_block(config)
    with pytest.raises(ValueError, match="holds no"):
        build_model_runner(
            EngineConfig(model=str(tiny), dtype="float32", device="cpu", kv_cache_gb=1e-9), tiny
        )


def test_the_warm_up_forward_runs_the_largest_step_and_a_steps_logit_rows(tiny: Path) -> None:
    config = EngineConfig(model=str(tiny), dtype="float32", device="cpu", max_num_seqs=8, block_size=16)
    attention = make_attention_backend(KernelBackend.TORCH)
    model, mc = load_model(tiny, torch.float32, "cpu", attention)
    logits = warm_up_forward(model, mc, config, torch.device("cpu"), KernelBackend.TORCH, num_tokens=100)
    assert logits.shape == (8, TINY["vocab_size"]) and bool(torch.isfinite(logits).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_kv_cache_fills_the_utilization_share(tiny: Path) -> None:
    config = EngineConfig(model=str(tiny), dtype="float32", device="cuda", gpu_memory_utilization=0.5)
    attention = make_attention_backend(KernelBackend.TRITON)
    model, mc = load_model(tiny, torch.float32, "cuda", attention)
    device = torch.device("cuda")
    num_blocks = kv_cache_blocks(config, model, mc, device, KernelBackend.TRITON, _bytes_per_block(config))
    total = torch.cuda.mem_get_info(device)[1]
    assert num_blocks >= 1 and num_blocks * _bytes_per_block(config) <= 0.5 * total
