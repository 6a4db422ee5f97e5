"""qlinear.c: block-quantized weights (Q8_0 / Q4_0 / Q4_1 / q8_c) against the torch spec, on both builds.

The spec (``kernels.quant_format.qlinear_reference``) quantizes x to int8 (as llama.cpp does) or int16
per block and sums the blocks in integers; the kernel must agree to float rounding, whatever the
batch, and the formats' dequantized values must equal the gguf package's (llama.cpp's) exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels.cpu.build import KernelBuildError
from kernels.cpu.qlinear import ACTIVATION_BITS, ISAS, QLinearKernel, load_qlinear_kernel
from kernels.gguf_types import from_gguf
from kernels.quant_format import GGUF_KINDS, KINDS, QuantizedWeight, UnsupportedQuantError, qlinear_reference
from worker.cpu_isa import probe
from worker.models.quant import quant_isa

# (rows, num_out, num_in): tails everywhere; 19 rows and 7 groups take the VNNI build's 512-bit tile
# over pairs of groups, 8 rows of x and then 3, with a lone group left over
SHAPES = [
    (1, 8, 32), (1, 7, 64), (3, 9, 96), (4, 16, 32), (5, 25, 64), (19, 50, 96), (33, 12, 128), (2, 40, 576),
]  # fmt: skip


def runnable(isa: str) -> bool:
    caps = probe()
    return caps.level.value >= 1 and (isa == "avx2" or "avx512_vnni" in caps.flags)


@pytest.fixture(scope="module", params=ISAS)
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> QLinearKernel:
    if not runnable(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} build ({probe().describe()})")
    try:
        return load_qlinear_kernel(request.param, tmp_path_factory.mktemp("kernels"))
    except KernelBuildError as exc:
        pytest.skip(f"no C compiler: {exc}")


def quantized(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """``weight`` in ``kind``; q8_c (which has no quantizer of its own) from a Q5_1 file's blocks."""
    if kind != "q8_c":
        return QuantizedWeight.quantize(weight, kind)
    raw = quantize(weight.numpy(), GGMLQuantizationType.Q5_1)
    return from_gguf("Q5_1", raw, tuple(weight.shape)).weight  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_dequantized_values_equal_llama_cpps(kind: str) -> None:
    weight = torch.randn(24, 96, generator=torch.Generator().manual_seed(0))
    qtype = GGMLQuantizationType[kind.upper()]
    expected = dequantize(quantize(weight.numpy(), qtype), qtype)
    assert torch.equal(QuantizedWeight.quantize(weight, kind).dequantize(), torch.from_numpy(expected))


@pytest.mark.parametrize("bits", ACTIVATION_BITS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("rows", "num_out", "num_in"), SHAPES)
def test_kernel_matches_the_spec(
    kernel: QLinearKernel, kind: str, bits: int, rows: int, num_out: int, num_in: int
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + num_out)
    weight = quantized(torch.randn(num_out, num_in, generator=gen), kind)
    x = torch.randn(rows, num_in, generator=gen) * 3
    x[0, 0] = 40.0  # an outlier, as real activations have: its block's scale is large
    bias = torch.randn(num_out, generator=gen)
    got = kernel.bind(weight, bias, bits)(x)
    expected = qlinear_reference(x, weight, bias, bits)
    torch.testing.assert_close(got, expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-5)
    # and the spec is the dequantized weight's product up to x's rounding: ~1% in int8, ~1e-4 in int16
    exact = x @ weight.dequantize().T + bias
    assert float((expected - exact).norm() / exact.norm()) < (0.03 if bits == 8 else 3e-4)


@pytest.mark.parametrize("bits", ACTIVATION_BITS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_does_not_depend_on_its_batch(kernel: QLinearKernel, kind: str, bits: int) -> None:
    gen = torch.Generator().manual_seed(7)
    bound = kernel.bind(quantized(torch.randn(72, 128, generator=gen), kind), None, bits)
    x = torch.randn(37, 128, generator=gen)
    batched = bound(x)
    for row in (0, 1, 2, 5, 36):
        assert torch.equal(bound(x[row : row + 1]), batched[row : row + 1])
        assert torch.equal(bound(x[row : row + 3])[0], batched[row])


def test_bad_inputs_are_refused(kernel: QLinearKernel) -> None:
    bound = kernel.bind(QuantizedWeight.quantize(torch.randn(8, 64), "q4_1"), None)
    with pytest.raises(ValueError, match=r"x: expected a \[M, 64\] float32"):
        bound(torch.randn(2, 32))
    with pytest.raises(ValueError, match="x: expected"):
        bound(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias"):
        kernel.bind(QuantizedWeight.quantize(torch.randn(8, 64), "q8_0"), torch.randn(7))
    with pytest.raises(ValueError, match="bits"):
        kernel.bind(QuantizedWeight.quantize(torch.randn(8, 64), "q8_0"), None, 4)


def test_formats_refuse_what_they_cannot_hold() -> None:
    with pytest.raises(UnsupportedQuantError, match="blocks of 32"):
        QuantizedWeight.quantize(torch.randn(4, 48), "q4_0")
    with pytest.raises(UnsupportedQuantError, match="q5_0"):
        QuantizedWeight.from_gguf_blocks("q5_0", np.zeros((4, 22), dtype=np.uint8), (4, 32))
    with pytest.raises(UnsupportedQuantError, match="no reference quantizer"):
        QuantizedWeight.quantize(torch.randn(4, 32), "q8_c")


def test_a_fused_projection_of_mixed_kinds_is_widened_exactly() -> None:
    gen = torch.Generator().manual_seed(5)
    parts = [quantized(torch.randn(8 + i, 64, generator=gen), k) for i, k in enumerate(KINDS)]
    fused = QuantizedWeight.cat(parts)
    assert fused.kind == "q8_c" and fused.shape == (sum(p.shape[0] for p in parts), 64)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    same = QuantizedWeight.cat(parts[2:3] * 2)  # one kind: stacked as it is
    assert same.kind == parts[2].kind


def test_the_probe_picks_a_build_this_cpu_runs() -> None:
    isa = quant_isa(probe())
    assert isa is None or runnable(isa)
    if isa is not None and "avx512_vnni" in probe().flags:
        assert isa == "avx512_vnni"


def test_build_is_cached(tmp_path: Path) -> None:
    if not runnable("avx2"):
        pytest.skip("needs AVX2")
    load_qlinear_kernel("avx2", tmp_path)
    built = sorted(tmp_path.glob("qlinear-avx2-*.so"))
    load_qlinear_kernel("avx2", tmp_path)
    assert sorted(tmp_path.glob("qlinear-avx2-*.so")) == built and len(built) == 1
