"""kernels/gguf_types.py: GGUF's k-quants and 5-bit types as the kernels' kinds, held to the gguf package.

Any bytes are a valid block once its float16 scales are finite, so each type is tried on random
blocks: the converted weight's values must be ``gguf.quants.dequantize``'s bit for bit (Q6_K: within
half a Q8_0 step and its scale's rounding, the
requantization it states).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels.gguf_types import SERVED_TYPES, from_gguf
from kernels.quant_format import UnsupportedQuantError

# type -> (bytes per block, values per block, byte offsets of its float16 scales)
LAYOUTS = {
    "Q5_0": (22, 32, (0,)),
    "Q5_1": (24, 32, (0, 2)),
    "Q4_K": (144, 256, (0, 2)),
    "Q5_K": (176, 256, (0, 2)),
    "Q6_K": (210, 256, (208,)),
}
EXACT = {"Q5_0": "q8_0", "Q5_1": "q8_c", "Q4_K": "q4_1", "Q5_K": "q8_c"}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """[rows, bytes per row] of random blocks with finite float16 scales ~ N(0, ``scale``)."""
    size, width, scales = LAYOUTS[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // width, size), dtype=np.uint8)
    for offset in scales:
        values = (rng.standard_normal(len(blocks)) * scale).astype(np.float16)
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", list(EXACT))
@pytest.mark.parametrize(("rows", "cols"), [(3, 256), (8, 512)])
def test_exact_types_keep_every_value(type_name: str, rows: int, cols: int) -> None:
    raw = random_blocks(type_name, rows, cols)
    converted = from_gguf(type_name, raw, (rows, cols))
    assert converted.weight.kind == EXACT[type_name] and not converted.requantized
    expected = dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols)
    assert torch.equal(converted.weight.dequantize(), torch.from_numpy(expected))


def test_q6_k_is_requantized_within_half_a_q8_step() -> None:
    raw = random_blocks("Q6_K", 4, 512)
    converted = from_gguf("Q6_K", raw, (4, 512))
    assert converted.weight.kind == "q8_0" and converted.requantized
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K).reshape(4, 512))
    got = converted.weight.dequantize()
    step = expected.view(4, 16, 32).abs().amax(-1, keepdim=True) / 127  # the Q8_0 scale of each block
    error = (got - expected).view(4, 16, 32).abs()
    # half a step, plus Q8_0's float16 scale rounded (2**-11 of it) times |q| <= 127
    assert bool((error <= step * (0.5 + 127 / 2048)).all())
    assert 0 < float((got - expected).norm() / expected.norm()) < 0.01


def test_gguf_types_read_as_they_are_pass_through() -> None:
    weight = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    raw = quantize(weight, GGMLQuantizationType.Q4_1)
    converted = from_gguf("Q4_1", raw, (4, 64))
    assert converted.weight.kind == "q4_1" and not converted.requantized
    expected = dequantize(raw, GGMLQuantizationType.Q4_1).reshape(4, 64)
    assert torch.equal(converted.weight.dequantize(), torch.from_numpy(expected))


def test_what_cannot_be_served_is_refused() -> None:
    assert "Q4_K" in SERVED_TYPES and "Q2_K" not in SERVED_TYPES
    with pytest.raises(UnsupportedQuantError, match="GGUF type Q2_K: served are Q8_0, Q4_0, Q4_1, Q5_0"):
        from_gguf("Q2_K", np.zeros((1, 84), dtype=np.uint8), (1, 256))
    with pytest.raises(UnsupportedQuantError, match="blocks of 256"):
        from_gguf("Q4_K", np.zeros((1, 72), dtype=np.uint8), (1, 128))
