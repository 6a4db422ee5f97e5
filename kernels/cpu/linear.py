"""float32 ``x @ w.T + b`` for the few rows of a decode step on CPU: the C kernels' launcher and the
torch reference (``F.linear``, the spec). The kernels are in ``linear_f32.c``; ``isa`` picks the
AVX-512 or the AVX2 one (the caller asks the CPU probe which can run).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu.build import load_library

SOURCE = Path(__file__).with_name("linear_f32.c")
ISAS = ("avx512", "avx2")


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class CpuLinearKernel:
    """One ISA's kernel, loaded. ``linear`` checks its arguments (``ValueError`` naming the bad one)."""

    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        if isa not in ISAS:
            raise ValueError(f"isa: expected one of {ISAS}, got {isa!r}")
        self.isa = isa
        self._fn = getattr(library, f"linear_f32_{isa}")
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        self._fn.restype = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K], weight [N, K], bias [N] or None, all float32 on CPU -> [M, N]."""
        _check(x, "x", 2)
        _check(weight, "weight", 2)
        num_rows, k = x.shape
        n = weight.shape[0]
        if weight.shape[1] != k:
            raise ValueError(
                f"weight: expected [N, {k}] for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}"
            )
        if bias is not None:
            _check(bias, "bias", 1)
            if bias.shape[0] != n:
                raise ValueError(f"bias: expected [{n}], got {tuple(bias.shape)}")
        out = torch.empty(num_rows, n, dtype=torch.float32)
        self._fn(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            num_rows,
            n,
            k,
            torch.get_num_threads(),
        )
        return out


def _check(t: torch.Tensor, name: str, ndim: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != ndim or not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous {ndim}-D float32 CPU tensor, got {t.dtype} on {t.device}, "
            f"shape {tuple(t.shape)}, strides {t.stride()}"
        )


def load_linear_kernel(isa: str, cache_dir: Path) -> CpuLinearKernel:
    """Build (once per cache folder) and load the kernel for ``isa``; ``KernelBuildError`` without a
    working C compiler."""
    return CpuLinearKernel(load_library(SOURCE, cache_dir), isa)
