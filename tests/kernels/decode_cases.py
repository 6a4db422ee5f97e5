"""What the fused decode layer's tests share (``test_cpu_decode.py``: against the torch path;
``test_cpu_decode_invariance.py``: a row's result whatever else the step holds): the builds this CPU
can run, the cache's shape, and the runner's step over a random cache."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kernels.cpu.decode import DecodeLayerKernel, load_decode_kernel
from worker.attention import allocate_kv_cache
from worker.cpu_isa import IsaLevel, probe
from worker.models.cpu_decode import CpuDecodeStep
from worker.models.cpu_linear import use_decode_linears
from worker.models.llama import LlamaForCausalLM

NEEDS = {"avx512": IsaLevel.AVX512, "avx2": IsaLevel.AVX2, "avx512_bf16": IsaLevel.AVX512_BF16}
BLOCK_SIZE = 4
NUM_BLOCKS = 160

# Models of a real model's attention shape, wider than the rest (192, 256): the bfloat16 builds are
# compared on the narrow ones, where their tolerances hold (here one K/V value that the two paths'
# float32 sums put on either side of a bf16 rounding boundary moves the next layer past them). The
# attention compiled for these shapes is one body for every build, the same bits as the general one.
WIDE = {"llama-group3-dim64", "mistral-group4-dim64-window"}


def skip_wide_bf16(kernel: DecodeLayerKernel, name: str) -> None:
    if name in WIDE and torch.bfloat16 in (kernel.dtype, kernel.kv_dtype):
        pytest.skip("a bfloat16 build on a wide model: beyond the bf16 tolerances (see WIDE)")


def key_id(key: tuple[object, ...]) -> str:
    return "-".join(str(part) for part in key).replace("torch.", "")


def load_build(key: tuple[torch.dtype, torch.dtype, str], cache_dir: Path) -> DecodeLayerKernel:
    """One of ``kernels.cpu.decode.KERNELS``' builds, or a skip where this CPU cannot run it."""
    dtype, kv_dtype, isa = key
    if probe().level < NEEDS[isa] or (dtype == torch.bfloat16 and not probe().native_bf16):
        pytest.skip(f"this CPU (as probed) cannot run the {isa} build (it is {probe().level.label})")
    return load_decode_kernel(isa, cache_dir, dtype, kv_dtype)


def fused_step(model: LlamaForCausalLM, kernel: DecodeLayerKernel, kernel_dir: Path) -> CpuDecodeStep:
    """The runner's fused step over a fresh random cache, the same each call (a float32 build over
    packed weights)."""
    cfg = model.config
    caches = allocate_kv_cache(
        cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, kernel.kv_dtype, "cpu"
    )
    gen = torch.Generator().manual_seed(11)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))
    return CpuDecodeStep(as_the_runner_gives_it(model, kernel, kernel_dir), caches, kernel)


def as_the_runner_gives_it(
    model: LlamaForCausalLM, kernel: DecodeLayerKernel, kernel_dir: Path
) -> LlamaForCausalLM:
    """The model a build reads: a float32 build its linears packed in panels (``use_decode_linears``,
    on a copy: the torch path keeps the original), the others the model itself."""
    if kernel.dtype != torch.float32 or kernel.quantized:
        return model
    packed = copy.deepcopy(model)
    assert use_decode_linears(packed, probe(), kernel_dir) > 0
    return packed
