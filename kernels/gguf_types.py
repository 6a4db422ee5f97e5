"""GGUF's other weight types as the block kernels' kinds (``kernels/quant_format.py``), most exactly.

Q8_0, Q4_0 and Q4_1 are read as they are. The rest are rewritten once, at load, into a kind of 32-wide
blocks with a float32 scale ``d`` and offset ``c`` per block (llama.cpp's k-quants are 256-wide
super-blocks of 32- or 16-wide sub-blocks; ``gguf.quants`` dequantizes every one of them, and the tests
hold each conversion to it):

=======  =============================================================  ========  =================
type     values                                                         kind      exact
=======  =============================================================  ========  =================
Q4_K     sub-block j of 32: (d sc_j) q - (dmin m_j), q 0..15            q4_1      yes
Q5_0     d (q - 16), q 0..31                                            q8_0      yes
Q5_1     d q + m, q 0..31                                               q8_c      yes
Q5_K     as Q4_K with q 0..31                                           q8_c      yes
Q6_K     sub-block j of 16: (d sc_j) (q - 32), q 0..63, sc_j int8       q8_0      no: requantized
=======  =============================================================  ========  =================

"Exact" means each weight's float32 value is the one ``gguf.quants.dequantize`` gives (scales are
fp16 x small integers, exact in float32). Q6_K's scales change every 16 values, finer than a block of
32 can hold, so its values are requantized to Q8_0 (255 levels a block, against Q6_K's 64 a
sub-block): each weight moves by at most half a Q8_0 step, ``max|w| / 254`` of its block (plus the
rounding of Q8_0's float16 scale), about a quarter of Q6_K's own step; ``GgufWeight.requantized``
says so and the loader logs it. Q2_K, Q3_K, the IQ and ternary types are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.quant_format import BLOCK, GGUF_KINDS, QuantizedWeight, UnsupportedQuantError

SUPER = 256  # a k-quant's super-block
# type -> bytes per block of its width (32, or SUPER for the k-quants)
_BYTES = {"Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
SERVED_TYPES = (*(k.upper() for k in GGUF_KINDS), *_BYTES)


@dataclass(slots=True, frozen=True)
class GgufWeight:
    """A GGUF tensor as a kernel kind; ``requantized``: its values moved (Q6_K), else exact."""

    weight: QuantizedWeight
    requantized: bool


def from_gguf(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> GgufWeight:
    """``raw``: a GGUF tensor's bytes, [N, bytes per row] uint8 (as ``GGUFReader`` maps them)."""
    if type_name.lower() in GGUF_KINDS:
        return GgufWeight(QuantizedWeight.from_gguf_blocks(type_name.lower(), raw, shape), False)
    if type_name not in _BYTES:
        raise UnsupportedQuantError(
            f"GGUF type {type_name}: served are {', '.join(SERVED_TYPES)} (and F32/F16/BF16)"
        )
    rows, cols = shape
    width = SUPER if type_name.endswith("_K") else BLOCK
    if cols % width:
        raise UnsupportedQuantError(f"a {type_name} weight needs rows in blocks of {width}, got {shape}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * (cols // width), _BYTES[type_name])
    if type_name == "Q6_K":
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(blocks, GGMLQuantizationType.Q6_K).reshape(rows, cols)
        return GgufWeight(QuantizedWeight.quantize(torch.from_numpy(values), "q8_0"), True)
    kind, q, d, c = _CONVERTERS[type_name](blocks)
    q = q.reshape(rows, cols)
    d, c = d.reshape(rows, cols // BLOCK), None if c is None else c.reshape(rows, cols // BLOCK)
    qs = _pack_nibbles(q) if kind == "q4_1" else torch.from_numpy(q.astype(np.int8))
    return GgufWeight(QuantizedWeight(kind, qs, _f32(d), None if c is None else _f32(c)), False)


def _f32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, widened: [n, 1]."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> torch.Tensor:
    """[N, K] quants 0..15 -> Q4_1's bytes: element j of a block low, element j + 16 high."""
    rows, cols = q.shape
    pairs = q.reshape(rows, cols // BLOCK, 2, BLOCK // 2).astype(np.uint8)
    return torch.from_numpy((pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(rows, cols // 2))


def _low_high(nibbles: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> [..., 2, n]: their low nibbles, then their high ones."""
    return np.stack([nibbles & 0x0F, nibbles >> 4], axis=-2)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: 4 bytes a block, bit j the fifth bit of element j -> [n, 32] of 0 / 16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits.astype(np.uint8) << 4


def _q5_0(blocks: np.ndarray) -> tuple[str, np.ndarray, np.ndarray, None]:
    n = len(blocks)
    q = _low_high(blocks[:, 6:22]).reshape(n, BLOCK) | _high_bits(blocks[:, 2:6])
    return "q8_0", q.astype(np.int16) - 16, _half(blocks, 0), None


def _q5_1(blocks: np.ndarray) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    n = len(blocks)
    q = _low_high(blocks[:, 8:24]).reshape(n, BLOCK) | _high_bits(blocks[:, 4:8])
    return "q8_c", q, _half(blocks, 0), _half(blocks, 2)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: d sc_j and -(dmin m_j) for the 8 sub-blocks, [n, 8] float32 each."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return _half(blocks, 0) * sc.astype(np.float32), -(_half(blocks, 2) * m.astype(np.float32))


def _q4_k(blocks: np.ndarray) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    # 4 chunks of 32 bytes: a chunk's low nibbles are sub-block 2i, its high ones 2i + 1
    q = _low_high(blocks[:, 16:144].reshape(-1, 4, 32)).reshape(-1, SUPER)
    d, c = _k_scales(blocks)
    return "q4_1", q, d, c


def _q5_k(blocks: np.ndarray) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    low = _low_high(blocks[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    # 32 bytes of high bits: bit j of byte i is the fifth bit of element i of sub-block j
    high = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    d, c = _k_scales(blocks)
    return "q8_c", (low | (high << 4)).reshape(-1, SUPER), d, c


_CONVERTERS = {"Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k, "Q5_K": _q5_k}
