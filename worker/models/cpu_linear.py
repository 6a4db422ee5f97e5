"""A CPU transform for a built model: its linears run our C kernels.

float32 (``kernels/cpu/linear_f32.c``): every linear at every row count, its weight packed in panels
of 48 rows (``PanelLinear``), a GEMM micro-kernel's layout: at batch 1 it streams the cold weights at
the read bandwidth (MKL's sgemm read them at ~12 GB/s on a 2-core EPYC, the kernel at ~25-40), and from
16 rows it runs near the FMA peak (AVX-512 Zen 5: 445 GFLOPS at 32 rows, MKL's sgemm 150-190; AVX2
~220, MKL 116-172; ``docs/benchmarks.md``). A tied model's embedding reads the same packed tensor
(``PanelEmbedding``): one copy of the logits matrix. bfloat16 on a CPU with AVX512-BF16
(``linear_bf16.c``, ``DecodeLinear``): ~30 GB/s at one row where oneDNN's packed GEMV read ~16; from
4 rows oneDNN's packed weights are a little faster layer for layer, and past ``MAX_ROWS`` the layer
calls ``F.linear`` (prefill, where oneDNN's repacking is paid once for many rows). The weights move
into one huge-page arena.

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
from kernels.cpu.linear import CpuLinearKernel, load_linear_kernel, pack_into, packed_shape
from worker.cpu_isa import CpuCaps, IsaLevel
from worker.models.llama import LlamaForCausalLM
from worker.models.weight_arena import WeightArena

log = logging.getLogger(__name__)

# Rows up to which the bfloat16 kernel serves (past them oneDNN's F.linear; the float32 kernels serve
# every row count).
MAX_ROWS: dict[str, int] = {"avx512_bf16": 32}


class PanelLinear(nn.Module):
    """A float32 linear by the C kernel at every row count, over its weight packed in panels
    (``kernels.cpu.linear.pack_weight``; arena memory)."""

    def __init__(
        self, packed: torch.Tensor, num_out: int, bias: torch.Tensor | None, kernel: CpuLinearKernel
    ) -> None:
        super().__init__()
        self.packed = nn.Parameter(packed.detach(), requires_grad=False)
        self.out_features, self.in_features = num_out, packed.shape[1]
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)
        self.kernel = kernel
        self.weight_bytes = packed.numel() * packed.element_size()
        self._bound = kernel.bind_packed(self.packed, num_out, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self._bound(x.contiguous())
        flat = self._bound(x.reshape(-1, self.in_features).contiguous())
        return flat.view(*x.shape[:-1], self.out_features)


class PanelEmbedding(nn.Module):
    """A tied model's token embedding, read from the logits' packed matrix: row ``v`` is
    ``packed[v // PANEL, :, v % PANEL]`` (one tensor for both, as the tied weight was)."""

    def __init__(self, lm_head: PanelLinear) -> None:
        super().__init__()
        self.lm_head = lm_head
        self.num_embeddings, self.embedding_dim = lm_head.out_features, lm_head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        return head.kernel.gather_rows(head.packed, self.num_embeddings, input_ids)


class DecodeLinear(nn.Module):
    """``F.linear`` whose small batches go to the bfloat16 C kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: CpuLinearKernel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)  # arena memory, not a copy
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)
        self.kernel = kernel
        self.max_rows = MAX_ROWS[kernel.isa]
        self._bound = kernel.bind(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows:
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
    streamed: list[torch.Tensor] = [child.weight.detach() for _, _, child in linears]
    if tied:
        streamed.append(model.embed_tokens.weight.detach())
    # float32: packed straight into the arena (the row-major weights go with the swapped modules)
    arena = WeightArena(streamed, packed_shape, pack_into) if kernel.packed else WeightArena(streamed)
    del streamed
    for (parent, name, child), arena_weight in zip(linears, arena.tensors, strict=False):
        setattr(parent, name, _swapped(arena_weight, child.out_features, child.bias, kernel))
    if tied:  # the embedding and the logits read one tensor, in the arena
        num_out = model.embed_tokens.weight.shape[0]
        model.lm_head = _swapped(arena.tensors[-1], num_out, None, kernel)
        if isinstance(model.lm_head, PanelLinear):
            model.embed_tokens = PanelEmbedding(model.lm_head)  # type: ignore[assignment]
        else:
            model.embed_tokens.weight = nn.Parameter(arena.tensors[-1], requires_grad=False)
    model.weight_arena = arena  # type: ignore[assignment]  # owns the mapping the weights live in
    count = len(linears) + tied
    log.info(
        "%d %s linears use the %s C kernel %s; %.0f MB of weights on %s pages",
        count,
        dtype,
        isa,
        "at any row count, packed in panels" if kernel.packed else f"up to {MAX_ROWS[isa]} rows",
        arena.num_bytes / 1e6,
        "2 MiB" if arena.huge_pages else "4 KiB",
    )
    return count


def _swapped(
    weight: torch.Tensor, num_out: int, bias: torch.Tensor | None, kernel: CpuLinearKernel
) -> nn.Module:
    if kernel.packed:
        return PanelLinear(weight, num_out, bias, kernel)
    return DecodeLinear(weight, bias, kernel)
