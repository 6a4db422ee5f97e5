"""``x @ w.T + b`` with block-quantized weights (``kernels/quant_format.py``) on CPU: the launcher of
``qlinear.c``. The spec is ``kernels.quant_format.qlinear_reference`` (x quantized to int8 per block,
integer block sums); the caller asks the CPU probe which build can run: ``avx512_vnni`` (AVX-512 with
VNNI) or ``avx2``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from kernels.cpu.build import load_library
from kernels.quant_format import BLOCK, BYTE_KINDS, QuantizedWeight

LANES = 8  # weight rows interleaved per group: one 32-bit lane each

SOURCE = Path(__file__).parent / "qlinear.c"
ISAS = ("avx512_vnni", "avx2")
ACTIVATION_BITS = (8, 16)
# qlinear.c's kind: 0 a byte a quant, 1 nibbles; Q4_0 / Q4_1 (and Q8_0 / q8_c) differ only in c
KIND_CODES = {"q8_0": 0, "q8_c": 0, "q4_0": 1, "q4_1": 1}


class QLinearKernel:
    """One ISA's build, loaded."""

    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        if isa not in ISAS:
            raise ValueError(f"isa: expected one of {ISAS}, got {isa!r}")
        self.isa = isa
        self._fn = getattr(library, f"qlinear_f32_{isa}")
        self._fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        self._fn.argtypes += [ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_int]
        self._fn.restype = None
        self._scratch_bytes = getattr(library, f"qlinear_scratch_bytes_{isa}")
        self._scratch_bytes.argtypes = [ctypes.c_int64] * 3
        self._scratch_bytes.restype = ctypes.c_int64

    def bind(self, weight: QuantizedWeight, bias: torch.Tensor | None, bits: int = 16) -> BoundQLinear:
        """``bits``: x's blocks in int8 (llama.cpp's arithmetic) or int16 (close to the float product)."""
        num_out = weight.shape[0]
        if bits not in ACTIVATION_BITS:
            raise ValueError(f"bits: expected one of {ACTIVATION_BITS}, got {bits!r}")
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (num_out,)):
            raise ValueError(f"bias: expected [{num_out}] float32, got {bias.dtype} {tuple(bias.shape)}")
        return BoundQLinear(self, pack(weight), None if bias is None else bias.contiguous(), bits)

    def scratch_bytes(self, bits: int, rows: int, cols: int) -> int:
        return int(self._scratch_bytes(bits, rows, cols))


class PackedQWeight:
    """A QuantizedWeight in the kernel's layout: eight rows interleaved per group (see qlinear.c)."""

    __slots__ = ("c", "d", "kind", "qs", "shape")

    def __init__(
        self, kind: str, shape: tuple[int, int], qs: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None
    ):
        self.kind, self.shape, self.qs, self.d, self.c = kind, shape, qs, d, c

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.c) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The weight's values [N, K] float32 (d q + c; for Q4_0 within an ulp of d (q - 8))."""
        rows, cols = self.shape
        groups, nb = self.qs.shape[0], cols // BLOCK
        if self.kind in BYTE_KINDS:
            q = self.qs.view(torch.int8).view(groups, nb, 8, LANES, 4).permute(0, 3, 1, 2, 4).float()
        else:
            nibbles = self.qs.view(groups, nb, 4, LANES, 4).to(torch.int32)
            halves = torch.stack([nibbles & 0xF, nibbles >> 4], dim=4)  # [G, b, q, lane, h, i]
            q = halves.permute(0, 3, 1, 2, 4, 5).float()
        q = q.reshape(groups * LANES, nb, BLOCK)

        def scales(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(groups * LANES, nb, 1)

        values = scales(self.d) * q + (0.0 if self.c is None else scales(self.c))
        return values.reshape(groups * LANES, cols)[:rows]


def pack(weight: QuantizedWeight) -> PackedQWeight:
    """Interleave ``weight``'s rows by eight (the last group padded with zero rows); values unchanged."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"weight: columns must be a multiple of {BLOCK}, got {weight.shape}")
    groups, nb = -(-rows // LANES), cols // BLOCK
    pad = groups * LANES - rows
    q = torch.nn.functional.pad(weight.quants(), (0, 0, 0, pad))
    if weight.kind in BYTE_KINDS:
        # [G, lane, b, q, i] -> [G, b, q, lane, i]: vector q of a block holds elements 4q + i
        lanes = q.to(torch.int8).view(groups, LANES, nb, 8, 4).permute(0, 2, 3, 1, 4)
        qs = lanes.contiguous().view(torch.uint8).reshape(groups, -1)
    else:
        # element 8q + 4h + i: nibble h of byte i in vector q
        halves = q.view(groups, LANES, nb, 4, 2, 4)
        nibbles = (halves[:, :, :, :, 0] | (halves[:, :, :, :, 1] << 4)).to(torch.uint8)
        qs = nibbles.permute(0, 2, 3, 1, 4).contiguous().reshape(groups, -1)

    def scales(t: torch.Tensor) -> torch.Tensor:
        return (
            torch.nn.functional.pad(t, (0, 0, 0, pad)).view(groups, LANES, nb).permute(0, 2, 1).contiguous()
        )

    c = None if weight.c is None else scales(weight.c)
    return PackedQWeight(weight.kind, weight.shape, qs, scales(weight.d), c)


class BoundQLinear:
    """One layer's weight bound to the kernel: only ``x`` per call."""

    __slots__ = ("_args", "_fn", "bias", "bits", "kernel", "num_in", "num_out", "weight")

    def __init__(
        self, kernel: QLinearKernel, weight: PackedQWeight, bias: torch.Tensor | None, bits: int
    ) -> None:
        self.kernel, self.weight, self.bias, self.bits = kernel, weight, bias, bits
        self.num_out, self.num_in = weight.shape
        c = weight.c.data_ptr() if weight.c is not None else None
        b = bias.data_ptr() if bias is not None else None
        self._fn = kernel._fn
        self._args: tuple[Any, ...] = (weight.qs.data_ptr(), weight.d.data_ptr(), c, b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.num_in or x.device.type != "cpu":
            raise ValueError(
                f"x: expected a [M, {self.num_in}] float32 CPU tensor, got {x.dtype} {tuple(x.shape)}"
            )
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.num_out, dtype=torch.float32)
        scratch = torch.empty(self.kernel.scratch_bytes(self.bits, rows, self.num_in), dtype=torch.uint8)
        qs, d, c, b = self._args
        self._fn(
            KIND_CODES[self.weight.kind], self.bits, x.data_ptr(), rows, self.num_in, scratch.data_ptr(),
            qs, d, c, b, out.data_ptr(), self.num_out, torch.get_num_threads(),
        )  # fmt: skip
        return out


def load_qlinear_kernel(isa: str, cache_dir: Path) -> QLinearKernel:
    """Build (once per cache folder) and load ``isa``'s kernel; ``KernelBuildError`` without a compiler."""
    if isa not in ISAS:
        raise ValueError(f"isa: expected one of {ISAS}, got {isa!r}")
    return QLinearKernel(load_library(SOURCE, cache_dir, isa), isa)
