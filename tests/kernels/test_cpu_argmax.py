"""The C row argmax equals torch's ``max(dim=-1).indices``: the first maximal index, the first NaN where
a row has one, across row counts, widths around its 64-wide blocks, ties, infinities and threads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels.cpu.argmax import RowArgmax, argmax_reference, load_argmax_kernel
from kernels.cpu.build import KernelBuildError, compiler

try:
    compiler()
    HAS_CC = True
except KernelBuildError:
    HAS_CC = False
pytestmark = pytest.mark.skipif(not HAS_CC, reason="no C compiler on PATH")
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def argmax(tmp_path_factory: pytest.TempPathFactory) -> RowArgmax:
    return load_argmax_kernel(tmp_path_factory.mktemp("kernels"))


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 3, 32, 65])
@pytest.mark.parametrize("cols", [1, 2, 63, 64, 65, 129, 1000, 49152])
def test_equals_reference_with_ties(argmax: RowArgmax, threads: int, rows: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100_000 + cols)
    # few distinct values: most rows hold their max more than once, in several blocks
    scores = torch.randint(-4, 4, (rows, cols), generator=gen).float()
    assert torch.equal(argmax(scores), argmax_reference(scores))
    spread = torch.randn(rows, cols, generator=gen)
    assert torch.equal(argmax(spread), argmax_reference(spread))


@pytest.mark.parametrize("cols", [1, 7, 64, 65, 300])
def test_nans_infinities_and_equal_rows(argmax: RowArgmax, threads: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    scores = torch.randn(12, cols, generator=gen)
    scores[0, 0] = NAN  # a NaN first
    scores[1, -1] = NAN  # last, after the row's max
    scores[2, cols // 2] = NAN
    scores[2, -1] = NAN  # the first of two wins
    scores[3] = -INF  # nothing above -inf: the first index
    scores[4, -1] = INF
    scores[5] = 1.5  # all equal
    scores[6, :] = -INF
    scores[6, -1] = NAN
    scores[7, cols // 3] = INF
    scores[7, -1] = INF
    scores[8, cols // 2 :] = NAN
    scores[9] = -0.0
    scores[9, -1] = 0.0  # equal to -0.0: the first index
    expected = argmax_reference(scores)
    got = argmax(scores)
    assert torch.equal(got, expected), (got.tolist(), expected.tolist())


def test_whatever_it_does_not_take_goes_to_the_reference(argmax: RowArgmax) -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(8, 100, generator=gen)
    for other in (scores.T, scores[:, ::2], scores.to(torch.bfloat16), scores[0], scores.view(2, 4, 100)):
        assert torch.equal(argmax(other), argmax_reference(other))
    assert argmax(torch.empty(0, 100)).shape == (0,)
    with pytest.raises((IndexError, RuntimeError)):  # as torch's max over an empty dimension
        argmax(torch.empty(3, 0))


def test_the_library_is_cached(tmp_path: Path) -> None:
    load_argmax_kernel(tmp_path)
    built = sorted(tmp_path.glob("argmax-*.so"))
    load_argmax_kernel(tmp_path)
    assert len(built) == 1 and sorted(tmp_path.glob("argmax-*.so")) == built
