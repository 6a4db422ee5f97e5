"""``x @ w.T + b`` on CPU: the C kernels' launcher and the torch reference (``F.linear``, the spec).
float32 (``linear_f32.c``: an AVX-512 and an AVX2 function, over the weight packed in panels of
``PANEL`` rows, ``pack_weight``) and bfloat16 (``linear_bf16.c``: AVX512-BF16 only, the weight as it
is); the caller asks the CPU probe which ISA can run.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.cpu.build import load_library

HERE = Path(__file__).parent
# (dtype, isa) -> (source, function)
KERNELS = {
    (torch.float32, "avx512"): (HERE / "linear_f32.c", "linear_f32_avx512"),
    (torch.float32, "avx2"): (HERE / "linear_f32.c", "linear_f32_avx2"),
    (torch.bfloat16, "avx512_bf16"): (HERE / "linear_bf16.c", "linear_bf16_avx512_bf16"),
}
SOURCE = HERE / "linear_f32.c"
ISAS = ("avx512", "avx2")  # the float32 ones
PANEL = 48  # linear_f32.c's PANEL (checked against the library when it loads)


def num_panels(num_out: int) -> int:
    """How many panels hold ``num_out`` weight rows: ``ceil(num_out / PANEL)``."""
    return -(-num_out // PANEL)


def packed_shape(weight: torch.Tensor) -> tuple[int, int, int]:
    """The shape ``pack_weight`` gives an ``[N, K]`` weight: ``(num_panels(N), K, PANEL)``."""
    num_out, num_in = weight.shape
    return num_panels(num_out), num_in, PANEL


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 ``[N, K]`` weight as ``linear_f32.c`` reads it: ``[ceil(N / PANEL), K, PANEL]``,
    ``packed[p, k, j] = weight[p * PANEL + j, k]``, the rows past N zero."""
    packed = weight.new_empty(packed_shape(weight))
    pack_into(weight, packed)
    return packed


def pack_into(weight: torch.Tensor, out: torch.Tensor) -> None:
    """``pack_weight`` written into ``out`` (contiguous, ``packed_shape(weight)``): no copy besides."""
    num_out, num_in = weight.shape
    full = num_out // PANEL
    if full:
        out[:full].copy_(weight[: full * PANEL].view(full, PANEL, num_in).transpose(1, 2))
    if num_out > full * PANEL:
        out[full].zero_()
        out[full, :, : num_out - full * PANEL].copy_(weight[full * PANEL :].T)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class CpuLinearKernel:
    """One (dtype, ISA) kernel, loaded. ``linear`` checks its arguments (``ValueError`` naming the bad
    one). ``packed``: the kernel reads its weight as ``pack_weight`` lays it out (float32)."""

    def __init__(self, library: ctypes.CDLL, isa: str, dtype: torch.dtype = torch.float32) -> None:
        if (dtype, isa) not in KERNELS:
            choices = [f"{d} {i}" for d, i in KERNELS]
            raise ValueError(f"isa: expected one of {choices}, got {dtype} {isa!r}")
        self.isa, self.dtype = isa, dtype
        self.packed = dtype == torch.float32
        if self.packed:
            library.linear_f32_panel.restype = ctypes.c_int64
            panel = library.linear_f32_panel()
            if panel != PANEL:
                raise ValueError(f"linear_f32.c packs {panel} rows a panel, PANEL is {PANEL}")
        self._fn = getattr(library, KERNELS[dtype, isa][1])
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        self._fn.restype = None
        self._gather = library.linear_f32_gather_rows if self.packed else None
        if self._gather is not None:
            self._gather.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
            self._gather.argtypes += [ctypes.c_int64, ctypes.c_void_p]
            self._gather.restype = ctypes.c_int64

    def gather_rows(self, packed: torch.Tensor, num_out: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape, int64) of a packed ``[num_out, K]`` weight: ``[*ids.shape, K]``
        (``IndexError`` for an id outside it, as an embedding's lookup)."""
        if self._gather is None:
            raise ValueError(f"the {self.dtype} kernel reads its weight unpacked")
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        num_in = packed.shape[1]
        out = torch.empty(flat.numel(), num_in, dtype=torch.float32)
        bad = self._gather(packed.data_ptr(), num_out, flat.data_ptr(), flat.numel(), num_in, out.data_ptr())
        if bad >= 0:
            raise IndexError(f"ids: expected values in [0, {num_out}), got {int(flat[bad])}")
        return out.view(*ids.shape, num_in)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K], weight [N, K], bias [N] or None, all of the kernel's dtype on CPU -> [M, N]."""
        return self.bind(weight, bias)(x)

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
        """The kernel for one layer: its weight (``[N, K]``; packed here where the kernel packs) and
        bias checked once, only ``x`` per call."""
        _check(weight, "weight", 2, self.dtype)
        if not self.packed:
            return self._bound(weight, weight.shape[0], bias)
        return self.bind_packed(pack_weight(weight), weight.shape[0], bias)

    def bind_packed(self, packed: torch.Tensor, num_out: int, bias: torch.Tensor | None) -> BoundLinear:
        """As ``bind``, over a weight already packed (``pack_weight``) into ``num_out`` rows."""
        if not self.packed:
            raise ValueError(f"the {self.dtype} kernel reads its weight unpacked")
        _check(packed, "packed weight", 3, self.dtype)
        panels = num_panels(num_out)
        if packed.shape[2] != PANEL or packed.shape[0] != panels:
            raise ValueError(f"packed weight: expected [{panels}, K, {PANEL}], got {tuple(packed.shape)}")
        return self._bound(packed, num_out, bias)

    def _bound(self, weight: torch.Tensor, num_out: int, bias: torch.Tensor | None) -> BoundLinear:
        if bias is not None:
            _check(bias, "bias", 1, self.dtype)
            if bias.shape[0] != num_out:
                raise ValueError(f"bias: expected [{num_out}], got {tuple(bias.shape)}")
        num_in = weight.shape[1]
        return BoundLinear(self._fn, weight, num_out, num_in, bias, self.dtype)


class BoundLinear:
    """``x @ weight.T + bias`` by the C kernel; holds the tensors it points into (``weight`` as the
    kernel reads it: packed for float32)."""

    __slots__ = ("_bias_ptr", "_fn", "_weight_ptr", "bias", "dtype", "num_in", "num_out", "weight")

    def __init__(
        self,
        fn: Any,
        weight: torch.Tensor,
        num_out: int,
        num_in: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        self._fn, self.dtype = fn, dtype
        self.weight, self.bias = weight, bias
        self.num_out, self.num_in = num_out, num_in
        self._weight_ptr = weight.data_ptr()
        self._bias_ptr = None if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype != self.dtype
            or x.dim() != 2
            or x.shape[1] != self.num_in
            or not x.is_contiguous()
            or x.device.type != "cpu"
        ):
            _check(x, "x", 2, self.dtype)
            raise ValueError(f"x: expected [M, {self.num_in}], got {tuple(x.shape)}")
        out = torch.empty(x.shape[0], self.num_out, dtype=self.dtype)
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


def _check(t: torch.Tensor, name: str, ndim: int, dtype: torch.dtype) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or t.dim() != ndim or not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous {ndim}-D {dtype} CPU tensor, got {t.dtype} on {t.device}, "
            f"shape {tuple(t.shape)}, strides {t.stride()}"
        )


def load_linear_kernel(isa: str, cache_dir: Path, dtype: torch.dtype = torch.float32) -> CpuLinearKernel:
    """Build (once per cache folder) and load the ``dtype`` kernel for ``isa``; ``KernelBuildError``
    without a working C compiler."""
    if (dtype, isa) not in KERNELS:
        raise ValueError(f"isa: no {dtype} kernel for {isa!r}")
    return CpuLinearKernel(load_library(KERNELS[dtype, isa][0], cache_dir), isa, dtype)
