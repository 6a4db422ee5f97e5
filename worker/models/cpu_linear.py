"""A CPU transform for a built model: its linears run our C kernels on decode-sized batches.

float32: at batch 1 MKL's sgemm read the cold weights at ~12 GB/s on a 2-core EPYC, the kernel at
~25-30 (``kernels/cpu/linear_f32.c``); up to ``MAX_ROWS`` rows it was faster at every size measured
(``docs/benchmarks.md``), and with AVX-512 at every size (MKL's sgemm runs an AVX2 kernel on an
EPYC). bfloat16 on a CPU with AVX512-BF16 (``linear_bf16.c``): ~30 GB/s at one row where oneDNN's
packed GEMV read ~16; from 4 rows oneDNN's packed weights are a little faster layer for layer, but
packing would keep a second copy of every weight, and the decode steps that matter run the fused
layer (``cpu_decode.py``) on these same weights. Past ``MAX_ROWS`` the layer calls ``F.linear``
(prefill, where MKL's / oneDNN's repacking is paid once for many rows). The weights move into one
huge-page arena (the tied lm_head reads the embedding, one tensor).

The probe chooses the ISA; the transform is skipped with one log line below AVX2 (float32), without
AVX512-BF16 (bfloat16: oneDNN's packing serves those, ``cpu_packing.py``) or without a C compiler.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu.build import KernelBuildError
from kernels.cpu.linear import CpuLinearKernel, load_linear_kernel
from worker.cpu_isa import CpuCaps, IsaLevel
from worker.models.llama import LlamaForCausalLM
from worker.models.weight_arena import WeightArena

log = logging.getLogger(__name__)

# Rows up to which the kernel serves (float32: it beat MKL at every size up to these, 2-core EPYC);
# None: every row count (AVX-512 float32, its 4x4 tile in blocks of 128 rows: ~300 GFLOPS from 128
# to 2,048 rows where MKL's sgemm ran 150-190 on the same Zen 5 EPYC).
MAX_ROWS: dict[str, int | None] = {"avx512": None, "avx2": 32, "avx512_bf16": 32}


class DecodeLinear(nn.Module):
    """``F.linear`` whose small batches go to the C kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: CpuLinearKernel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)  # arena memory, not a copy
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)
        self.kernel = kernel
        self.max_rows = MAX_ROWS[kernel.isa]
        self._bound = kernel.bind(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and (self.max_rows is None or x.shape[0] <= self.max_rows):
            return self._bound(x.contiguous())
        return F.linear(x, self.weight, self.bias)


def kernel_isa(caps: CpuCaps, dtype: torch.dtype) -> str | None:
    if dtype == torch.bfloat16:
        return "avx512_bf16" if caps.native_bf16 else None
    if caps.level >= IsaLevel.AVX512:
        return "avx512"
    if caps.level >= IsaLevel.AVX2:
        return "avx2"
    return None


def use_decode_linears(model: LlamaForCausalLM, caps: CpuCaps | None, cache_dir: Path) -> int:
    """Swap every nn.Linear (and the tied lm_head) of a float32 or bfloat16 CPU model; returns how
    many (0: skipped, with the reason logged)."""
    weight = next(model.parameters())
    dtype = weight.dtype
    if caps is None or weight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return 0
    isa = kernel_isa(caps, dtype)
    if isa is None:
        need = "AVX512-BF16" if dtype == torch.bfloat16 else "AVX2"
        log.info("%s linears: no C kernel (it needs %s, the CPU is %s)", dtype, need, caps.level.label)
        return 0
    try:
        kernel = load_linear_kernel(isa, cache_dir, dtype)
    except KernelBuildError as exc:
        log.info("%s linears: no C kernel: %s", dtype, exc)
        return 0
    linears = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if isinstance(child, nn.Linear)
    ]
    tied = model.lm_head is None
    streamed = [child.weight for _, _, child in linears] + ([model.embed_tokens.weight] if tied else [])
    arena = WeightArena([w.detach() for w in streamed])
    for (parent, name, child), streamed_weight in zip(linears, arena.tensors, strict=False):
        setattr(parent, name, DecodeLinear(streamed_weight, child.bias, kernel))
    if tied:  # the embedding and the logits read one tensor, in the arena
        model.embed_tokens.weight = nn.Parameter(arena.tensors[-1], requires_grad=False)
        model.lm_head = DecodeLinear(arena.tensors[-1], None, kernel)
    model.weight_arena = arena  # type: ignore[assignment]  # owns the mapping the weights live in
    count = len(linears) + tied
    log.info(
        "%d %s linears use the %s C kernel %s; %.0f MB of weights on %s pages",
        count,
        dtype,
        isa,
        "at any row count" if MAX_ROWS[isa] is None else f"up to {MAX_ROWS[isa]} rows",
        arena.num_bytes / 1e6,
        "2 MiB" if arena.huge_pages else "4 KiB",
    )
    return count
