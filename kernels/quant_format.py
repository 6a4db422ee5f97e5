"""Block-quantized weights as the kernels take them: GGUF's Q8_0, Q4_0 and Q4_1, their values kept.

GGUF stores a [N, K] weight row by row in blocks of 32 values, each block a float16 scale ``d`` (Q4_1:
and a float16 ``m``) followed by its quants: Q8_0 32 signed bytes (w = d q); Q4_0 16 bytes of nibbles
(w = d (q - 8)); Q4_1 the same nibbles (w = d q + m). A byte j holds element j in its low nibble and
element j + 16 in its high one. :class:`QuantizedWeight` keeps the quants bytes as they are and widens
the scales to float32 in arrays of their own, so a kernel reads a row's quants contiguously:

    qs  [N, K] int8 (Q8_0) or [N, K / 2] uint8 (Q4)     d, c  [N, K / 32] float32

``c`` is the per-block offset term: ``m`` for Q4_1, ``-8 d`` for Q4_0 (none for Q8_0), so that
``sum_k w x = d * sum_k q x + c * sum_k x`` over a block, the form ``kernels/cpu/qlinear.c`` computes.

One kind is ours, not a GGUF type: ``q8_c``, int8 quants with an offset (w = d q + c). It holds
exactly what has no GGUF kind of its own here: 5-bit quants with a minimum (Q5_1, Q5_K: q in 0..31),
and a fused projection whose parts come in different types (q4_* quants fit int8 unchanged).
``kernels/gguf_types.py`` converts GGUF's other types into these kinds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
# kind -> (GGUF block bytes, whether it has m, bytes of quants per block)
_LAYOUT = {"q8_0": (34, False, 32), "q4_0": (18, False, 16), "q4_1": (20, True, 16)}
GGUF_KINDS = tuple(_LAYOUT)  # read from a file's blocks as they are
KINDS = (*GGUF_KINDS, "q8_c")
BYTE_KINDS = ("q8_0", "q8_c")  # one int8 quant a byte (the rest: two nibbles)


class UnsupportedQuantError(ValueError):
    """A quantization type (or a tensor shape) the block kernels do not take."""


@dataclass(slots=True, frozen=True)
class QuantizedWeight:
    """A [N, K] weight in 32-wide blocks (see the module docstring)."""

    kind: str
    qs: torch.Tensor  # [N, K] int8 (q8_*) or [N, K // 2] uint8 (q4_*)
    d: torch.Tensor  # [N, K // 32] float32
    c: torch.Tensor | None  # [N, K // 32] float32 (q4_*, q8_c), None for q8_0

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.qs.shape
        return rows, width if self.kind in BYTE_KINDS else 2 * width

    @property
    def num_bytes(self) -> int:
        tensors = (self.qs, self.d) + (() if self.c is None else (self.c,))
        return sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def bytes_for(kind: str, shape: tuple[int, int]) -> int:
        """What a [N, K] weight of ``kind`` takes (quants, float32 d, and c where the kind has one)."""
        rows, cols = shape
        quants = rows * cols if kind in BYTE_KINDS else rows * cols // 2
        return quants + 4 * rows * (cols // BLOCK) * (1 if kind == "q8_0" else 2)

    @classmethod
    def from_gguf_blocks(cls, kind: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
        """``raw``: a GGUF tensor's bytes, [N, bytes per row] uint8 (what ``GGUFReader`` maps)."""
        if kind not in GGUF_KINDS:
            raise UnsupportedQuantError(f"{kind!r} is not a GGUF block type read as it is")
        _check_kind(kind, shape)
        rows, cols = shape
        block_bytes, has_m, quant_bytes = _LAYOUT[kind]
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // BLOCK, block_bytes)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        quants = blocks[..., block_bytes - quant_bytes :].reshape(rows, -1)
        if kind == "q8_0":
            qs = torch.from_numpy(quants.copy().view(np.int8))
            return cls(kind, qs, torch.from_numpy(d), None)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_m else None
        c = -8.0 * d if m is None else m
        return cls(kind, torch.from_numpy(quants.copy()), torch.from_numpy(d), torch.from_numpy(c))

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str) -> QuantizedWeight:
        """``weight`` [N, K] float quantized as llama.cpp's reference quantizer does (the gguf package)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        if kind not in GGUF_KINDS:
            raise UnsupportedQuantError(f"quantize: {kind!r} has no reference quantizer")
        _check_kind(kind, tuple(weight.shape))
        raw = quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType[kind.upper()])
        return cls.from_gguf_blocks(kind, raw, tuple(weight.shape))  # type: ignore[arg-type]

    def quants(self) -> torch.Tensor:
        """The integer quants [N, K] as int32 (Q4: 0..15, before the -8 or the m)."""
        if self.kind in BYTE_KINDS:
            return self.qs.to(torch.int32)
        rows, width = self.qs.shape
        nibbles = self.qs.view(rows, width // 16, 16).to(torch.int32)
        return torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(rows, 2 * width)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's values [N, K], exactly (each is d q + c in float32, as llama.cpp computes it)."""
        rows, cols = self.shape
        q = self.quants().view(rows, cols // BLOCK, BLOCK).float()
        values = self.d[..., None] * (q - 8.0 if self.kind == "q4_0" else q)
        if self.kind in ("q4_1", "q8_c"):
            assert self.c is not None
            values = values + self.c[..., None]
        return values.reshape(rows, cols).to(dtype)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight with its tensors on ``device``."""
        c = None if self.c is None else self.c.to(device)
        return QuantizedWeight(self.kind, self.qs.to(device), self.d.to(device), c)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows ``index`` (e.g. an embedding lookup) as a QuantizedWeight."""
        return QuantizedWeight(
            self.kind, self.qs[index], self.d[index], None if self.c is None else self.c[index]
        )

    def widened(self) -> QuantizedWeight:
        """The same values as ``q8_c`` (int8 quants and an offset), exactly: what a fused projection of
        mixed kinds stacks (its 4-bit parts then read a byte a quant)."""
        if self.kind == "q8_c":
            return self
        q = self.quants() - (8 if self.kind == "q4_0" else 0)
        c = torch.zeros_like(self.d) if self.kind in ("q8_0", "q4_0") else self.c
        assert c is not None
        return QuantizedWeight("q8_c", q.to(torch.int8), self.d, c)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of ``parts`` stacked (fused projections); parts of different kinds are widened to
        ``q8_c`` first (values unchanged)."""
        if len({p.kind for p in parts}) > 1:
            parts = [p.widened() for p in parts]
        c = None if parts[0].c is None else torch.cat([p.c for p in parts if p.c is not None])
        return QuantizedWeight(
            parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), c
        )


def _check_kind(kind: str, shape: tuple[int, ...]) -> None:
    if kind not in _LAYOUT:
        raise UnsupportedQuantError(f"quantization {kind!r}: the block kernels take {', '.join(KINDS)}")
    if len(shape) != 2 or shape[1] % BLOCK:
        raise UnsupportedQuantError(f"a {kind} weight needs [N, K] with K in blocks of {BLOCK}, got {shape}")


def quantize_activations(x: torch.Tensor, bits: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (qx [M, K] int8 or int16, dx [M, K/32], sx [M, K/32]) as the C kernel
    computes them: d = max|x| / (2**(bits-1) - 1) per block, q = round-half-even(x * (1 / d)),
    s = d * sum(q). (The kernel stores int16 blocks in another order; the values are these.)"""
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / float(2 ** (bits - 1) - 1)
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None])
    s = d * q.sum(dim=-1)
    return q.to(torch.int8 if bits == 8 else torch.int16).reshape(rows, cols), d, s


def qlinear_reference(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, bits: int = 16
) -> torch.Tensor:
    """The kernel's arithmetic in torch (the spec it is tested against): x [M, K] -> [M, N] float32."""
    rows, cols = x.shape
    qx, dx, sx = quantize_activations(x, bits)
    nb = cols // BLOCK
    qw = weight.quants()  # Q4: the nibbles as they are; the -8 or the m is in c
    # Integer block sums, exact in float64 (|sum| <= 32 * 127 * 32767 < 2**53), as the kernel's int32.
    sums = torch.einsum("mbk,nbk->mnb", qx.view(rows, nb, BLOCK).double(), qw.view(-1, nb, BLOCK).double())
    y = (sums.float() * weight.d[None] * dx[:, None]).sum(-1)
    if weight.c is not None:
        y = y + sx @ weight.c.T
    if bias is not None:
        y = y + bias.float()
    return y
