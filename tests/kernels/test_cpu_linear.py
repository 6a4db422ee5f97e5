"""The C linear kernels equal their reference (F.linear) across shapes, tails and bias: float32 on AVX-512
and AVX2 (over weights packed in panels), bfloat16 on AVX512-BF16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.cpu.build import KernelBuildError, load_library
from kernels.cpu.linear import (
    ISAS,
    PANEL,
    SOURCE,
    CpuLinearKernel,
    linear_reference,
    load_linear_kernel,
    num_panels,
    pack_into,
    pack_weight,
    packed_shape,
)
from tests.kernels.cc import NEEDS_CC
from worker.cpu_isa import IsaLevel, probe
from worker.models.weight_arena import WeightArena

NEEDS = {"avx512": IsaLevel.AVX512, "avx2": IsaLevel.AVX2}

pytestmark = NEEDS_CC


@pytest.fixture(scope="module", params=ISAS)
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CpuLinearKernel:
    isa = request.param
    if probe().native_level < NEEDS[isa]:
        pytest.skip(f"this CPU cannot run the {isa} kernel (it is {probe().native_level.label})")
    return load_linear_kernel(isa, tmp_path_factory.mktemp("kernels"))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 33, 200, 259])  # 259: two passes over w, 136 + 123
@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 5), (4, 16), (13, 37), (64, 576), (7, 1536), (130, 200)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_reference(kernel: CpuLinearKernel, rows: int, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    expected = linear_reference(x, weight, bias)
    # Another summation order than MKL's: equal to float32 rounding of a k-term dot product.
    got = kernel.linear(x, weight, bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * k**0.5)
    # every output the same sequential sum whatever the tile: a row alone equals it in its batch
    bound = kernel.bind(weight, bias)
    assert all(torch.equal(bound(x[i : i + 1].contiguous())[0], got[i]) for i in (0, rows // 2, rows - 1))


@pytest.mark.parametrize("rows", [1, 6, 13])
def test_both_isas_give_the_same_bits(rows: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """AVX-512 and AVX2 sum each output alike (one FMA a k, in order): equal bit for bit."""
    if probe().native_level < IsaLevel.AVX512:
        pytest.skip(f"needs both ISAs (this CPU is {probe().native_level.label})")
    folder = tmp_path_factory.mktemp("kernels")
    wide, narrow = load_linear_kernel("avx512", folder), load_linear_kernel("avx2", folder)
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 200, generator=gen), torch.randn(100, 200, generator=gen)
    bias = torch.randn(100, generator=gen)
    assert torch.equal(wide.linear(x, weight, bias), narrow.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [2, 260])  # 260: two passes of rows, the first prefetching for the second
def test_any_thread_count_gives_the_same_bits(kernel: CpuLinearKernel, rows: int) -> None:
    """The panels are split among the threads (six here, the last partial: uneven at 4 threads, none
    left for two of 8); each output is summed by one thread alone, so the split moves no bit."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 64, generator=gen), torch.randn(5 * PANEL + 7, 64, generator=gen)
    bound = kernel.bind(weight, torch.randn(5 * PANEL + 7, generator=gen))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 4, 8):
            torch.set_num_threads(threads)
            outs.append(bound(x))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    torch.testing.assert_close(outs[0], linear_reference(x, weight, bound.bias), rtol=1e-5, atol=1e-4)


def unpack_weight(packed: torch.Tensor, num_out: int) -> torch.Tensor:
    """``pack_weight``'s inverse: the ``[num_out, K]`` weight (a copy)."""
    panels, num_in, panel = packed.shape
    return packed.transpose(1, 2).reshape(panels * panel, num_in)[:num_out].clone()


@pytest.mark.parametrize("n", [1, PANEL - 1, PANEL, PANEL + 1, 3 * PANEL + 5])
def test_packing_round_trips(n: int) -> None:
    weight = torch.randn(n, 37)
    packed = pack_weight(weight)
    assert packed.shape == (num_panels(n), 37, PANEL) and packed.is_contiguous()
    assert torch.equal(unpack_weight(packed, n), weight)
    assert torch.equal(packed[(n - 1) // PANEL, :, (n - 1) % PANEL], weight[n - 1])
    assert not packed.transpose(1, 2).reshape(-1, 37)[n:].any()  # the last panel's rows past n are zero
    # packed in place into an arena (no packed copy first), over memory that was not zero
    arena = WeightArena([weight, weight], packed_shape, lambda w, out: (out.fill_(7.0), pack_into(w, out)))
    assert all(torch.equal(t, packed) for t in arena.tensors)


@pytest.fixture(scope="module")
def bf16_kernel(tmp_path_factory: pytest.TempPathFactory) -> CpuLinearKernel:
    if not probe().native_bf16:
        pytest.skip(f"this CPU has no AVX512-BF16 (it is {probe().level.label})")
    return load_linear_kernel("avx512_bf16", tmp_path_factory.mktemp("kernels"), torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 5), (4, 32), (13, 37), (64, 576), (7, 1536), (130, 200)])
def test_bf16_kernel_is_the_float32_sum_rounded_once(
    bf16_kernel: CpuLinearKernel, rows: int, n: int, k: int
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    exact = linear_reference(x.float(), weight.float(), bias.float())
    got = bf16_kernel.linear(x, weight, bias)
    assert got.dtype == torch.bfloat16
    # products of bf16 are exact in float32: only the sum's order and the one final rounding differ
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-5 * k**0.5)
    # each output summed alike whatever the batch: a row's result does not depend on its neighbours
    alone = torch.cat([bf16_kernel.linear(x[i : i + 1].contiguous(), weight, bias) for i in range(rows)])
    assert torch.equal(alone, got)


def test_bad_arguments_name_themselves(kernel: CpuLinearKernel) -> None:
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="x: expected"):
        kernel.linear(x, torch.randn(4, 9), None)
    with pytest.raises(ValueError, match="x: expected a contiguous"):
        kernel.linear(torch.randn(8, 2).t(), weight, None)
    with pytest.raises(ValueError, match="x: expected a contiguous"):
        kernel.linear(x.double(), weight, None)
    with pytest.raises(ValueError, match="bias: expected"):
        kernel.linear(x, weight, torch.randn(5))
    with pytest.raises(ValueError, match="packed weight: expected"):
        kernel.bind_packed(pack_weight(weight), 2 * PANEL, None)


def test_the_library_is_built_once_per_source_and_compiler(tmp_path: Path) -> None:
    load_library(SOURCE, tmp_path)
    [built] = tmp_path.glob("linear_f32-*.so")
    mtime = built.stat().st_mtime_ns
    load_library(SOURCE, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [built.name] and built.stat().st_mtime_ns == mtime


def test_a_missing_compiler_is_a_build_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(KernelBuildError, match="no C compiler"):
        load_linear_kernel("avx2", tmp_path)
    with pytest.raises(ValueError, match="isa: expected one of"):
        CpuLinearKernel(None, "sse")  # type: ignore[arg-type]  # checked before the library is read
    with pytest.raises(ValueError, match=r"isa: no torch\.bfloat16 kernel for 'avx2'"):
        load_linear_kernel("avx2", tmp_path, torch.bfloat16)
