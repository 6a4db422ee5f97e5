"""Triton qlinear (weight-only Q8_0 / Q4_0 / Q4_1) against ``qlinear_dequant_reference`` (the spec).

On CPU it runs under Triton's interpreter (see conftest.py); with a CUDA device, compiled on it. Shapes
are swept in fp32, dtypes on one shape. M = 17 already takes the prefill tiles (``DECODE_MAX_ROWS``).

Tolerance, per output: ``|y - ref| <= u * (sum_k |x_k w_k| + |bias| + |ref|)``. The kernel rounds each
dequantized weight to x's dtype before the dot (the reference keeps it fp32) and both round y once; the
fp32 sums differ only in order. Each such rounding is within one unit ``u`` of its dtype (the
interpreter truncates bf16 casts rather than rounding them, hence one ulp, not half): bf16 2^-7, fp16
2^-10 (it rounds x to nearest, so this is two half-ulps), fp32 1e-6 (reordering 256 fp32 products stays
far below it). A wrong nibble, block or scale costs of order ``|x w|`` per element, far above the bound.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("gguf")

import kernels.triton_ops as tk
from kernels.qlinear_reference import qlinear_dequant_reference
from kernels.quant_format import QuantizedWeight

KINDS = ("q8_0", "q4_0", "q4_1")  # the GGUF kinds, quantized by the gguf package (q8_c: see its test)
UNIT = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _weight(num_out: int, num_in: int, kind: str, device: torch.device, seed: int) -> QuantizedWeight:
    values = torch.randn(num_out, num_in, generator=torch.Generator().manual_seed(seed))
    return QuantizedWeight.quantize(values, kind).to(device)


def _assert_matches(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    got = tk.qlinear(x, weight, bias)
    expected = qlinear_dequant_reference(x, weight, bias)
    assert got.dtype == x.dtype and got.shape == expected.shape
    scale = x.float().abs() @ weight.dequantize().abs().T + expected.float().abs()
    if bias is not None:
        scale = scale + bias.float().abs()
    excess = (got.float() - expected.float()).abs() / (UNIT[x.dtype] * scale)
    assert excess.max() <= 1.0, f"error {excess.max():.2f}x the bound ({weight.kind}, {tuple(x.shape)})"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_in", [32, 96, 256])
@pytest.mark.parametrize("num_out", [8, 40, 72])
@pytest.mark.parametrize("num_rows", [1, 3, 17])
def test_qlinear_shapes(num_rows: int, num_out: int, num_in: int, kind: str, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(num_rows * 1000 + num_out * 10 + num_in)
    x = torch.randn(num_rows, num_in, generator=gen).to(device)
    bias = torch.randn(num_out, generator=gen).to(device)
    _assert_matches(x, _weight(num_out, num_in, kind, device, seed=num_in + num_out), bias)


@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_qlinear_dtypes_and_batch_dims(
    kind: str, dtype: torch.dtype, has_bias: bool, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 96, generator=gen).to(dtype).to(device)
    bias = torch.randn(40, generator=gen).to(dtype).to(device) if has_bias else None
    _assert_matches(x, _weight(40, 96, kind, device, seed=3), bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlinear_q8_c_of_a_fused_projection(dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(11)
    parts = [
        QuantizedWeight.quantize(torch.randn(num_out, 64, generator=gen), kind)
        for num_out, kind in ((24, "q4_1"), (8, "q8_0"), (8, "q4_0"))
    ]
    fused = QuantizedWeight.cat(parts)  # mixed kinds: widened to q8_c (int8 quants, offset c)
    assert fused.kind == "q8_c"
    x = torch.randn(5, 64, generator=gen).to(dtype).to(device)
    _assert_matches(x, fused.to(device), torch.randn(40, generator=gen).to(device))


def test_qlinear_strided_rows_empty_batch_and_fp32_bias(device: torch.device) -> None:
    weight = _weight(24, 64, "q4_1", device, seed=5)
    wide = torch.randn(5, 200).to(torch.float16).to(device)
    _assert_matches(wide[:, 8:72], weight, torch.randn(24).to(device))  # row stride 200, bias in fp32
    empty = tk.qlinear(torch.zeros(0, 64).to(device), weight, None)
    assert empty.shape == (0, 24)


def test_qlinear_names_what_is_wrong(device: torch.device) -> None:
    weight = _weight(16, 64, "q4_0", device, seed=1)
    x = torch.randn(2, 64).to(device)
    cases = [
        (torch.randn(2, 32).to(device), weight, None, r"x: expected \[\.\.\., 64\]"),
        (x.to(torch.int32), weight, None, "x: dtype"),
        (torch.randn(2, 3, 128).to(device)[..., ::2], weight, None, "x: last dim must be contiguous"),
        (torch.randn(3, 2, 64).to(device).transpose(0, 1), weight, None, "x: a 3-d input must be contiguous"),
        (x, weight, torch.randn(15).to(device), r"bias: expected \[16\]"),
        (x, weight, torch.ones(16, dtype=torch.int64).to(device), "bias: dtype"),
        (x.to("meta"), weight, None, "different devices"),
        (x, QuantizedWeight("q5_0", weight.qs, weight.d, weight.c), None, "weight.kind 'q5_0'"),
        (x, QuantizedWeight("q8_0", weight.qs, weight.d, None), None, "weight.qs: q8_0 needs torch.int8"),
        (x, QuantizedWeight("q4_1", weight.qs, weight.d, None), None, "weight.c: a q4_1 weight needs c"),
        (
            x,
            QuantizedWeight("q4_0", weight.qs, weight.d[:, :1], weight.c),
            None,
            r"weight.d: expected \(16, 2\)",
        ),
        (
            x,
            QuantizedWeight("q4_0", weight.qs, weight.d, weight.c.double()),
            None,
            "weight.c: expected float32",
        ),
    ]
    for bad_x, bad_weight, bias, message in cases:
        with pytest.raises(ValueError, match=message):
            tk.qlinear(bad_x, bad_weight, bias)


def test_a_quantized_weight_moves_every_tensor(device: torch.device) -> None:
    for kind in KINDS:
        weight = QuantizedWeight.quantize(torch.randn(8, 32), kind)
        moved = weight.to("meta")
        tensors = [moved.qs, moved.d] + ([] if moved.c is None else [moved.c])
        assert moved.kind == kind and (moved.c is None) == (weight.c is None)
        assert all(t.device.type == "meta" for t in tensors)
        back = weight.to(device).to("cpu")
        assert torch.equal(back.dequantize(), weight.dequantize())
