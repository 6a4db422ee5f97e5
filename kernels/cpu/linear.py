"""float32 ``x @ w.T + b`` for the few rows of a decode step on CPU: the C kernels' launcher and the
torch reference (``F.linear``, the spec). The kernels are in ``linear_f32.c``; ``isa`` picks the
AVX-512 or the AVX2 one (the caller asks the CPU probe which can run).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

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
        return self.bind(weight, bias)(x)

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
        """The kernel for one layer: its weight and bias checked once, only ``x`` per call."""
        _check(weight, "weight", 2)
        if bias is not None:
            _check(bias, "bias", 1)
            if bias.shape[0] != weight.shape[0]:
                raise ValueError(f"bias: expected [{weight.shape[0]}], got {tuple(bias.shape)}")
        return BoundLinear(self._fn, weight, bias)


class BoundLinear:
    """``x @ weight.T + bias`` by the C kernel; holds the tensors it points into."""

    __slots__ = ("_bias_ptr", "_fn", "_weight_ptr", "bias", "num_in", "num_out", "weight")

    def __init__(self, fn: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._fn = fn
        self.weight, self.bias = weight, bias
        self.num_out, self.num_in = weight.shape
        self._weight_ptr = weight.data_ptr()
        self._bias_ptr = None if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype != torch.float32
            or x.dim() != 2
            or x.shape[1] != self.num_in
            or not x.is_contiguous()
            or x.device.type != "cpu"
        ):
            _check(x, "x", 2)
            raise ValueError(f"x: expected [M, {self.num_in}], got {tuple(x.shape)}")
        out = torch.empty(x.shape[0], self.num_out, dtype=torch.float32)
        self._fn(
            x.data_ptr(),
            self._weight_ptr,
            self._bias_ptr,
            out.data_ptr(),
            x.shape[0],
            self.num_out,
            self.num_in,
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
