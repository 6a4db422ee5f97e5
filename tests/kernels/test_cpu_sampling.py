"""The sampler's row operations in C equal their torch references (``kernels/sampling.py``), and the
references follow their rules: the argmax is torch's ``max(dim=-1).indices`` (the first maximal index,
the first NaN where a row has one); the top-k / top-p cut keeps exactly the tokens the rule keeps."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels.cpu.sampling import CpuSamplingOps, load_sampling_kernels
from kernels.sampling import TORCH_SAMPLING, race_uniforms
from tests.kernels.cc import NEEDS_CC

pytestmark = NEEDS_CC
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> CpuSamplingOps:
    return load_sampling_kernels(tmp_path_factory.mktemp("kernels"))


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# ---- argmax ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 32, 65])
@pytest.mark.parametrize("cols", [1, 2, 63, 64, 65, 129, 1000, 49152])
def test_argmax_equals_reference_with_ties(ops: CpuSamplingOps, threads: int, rows: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100_000 + cols)
    # few distinct values: most rows hold their max more than once, in several blocks
    scores = torch.randint(-4, 4, (rows, cols), generator=gen).float()
    assert torch.equal(ops.argmax(scores), TORCH_SAMPLING.argmax(scores))
    spread = torch.randn(rows, cols, generator=gen)
    assert torch.equal(ops.argmax(spread), TORCH_SAMPLING.argmax(spread))


@pytest.mark.parametrize("cols", [1, 7, 64, 65, 300])
def test_argmax_nans_infinities_and_equal_rows(ops: CpuSamplingOps, threads: int, cols: int) -> None:
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
    expected = TORCH_SAMPLING.argmax(scores)
    got = ops.argmax(scores)
    assert torch.equal(got, expected), (got.tolist(), expected.tolist())


def test_argmax_takes_to_the_reference_what_it_does_not_take(ops: CpuSamplingOps) -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(8, 100, generator=gen)
    for other in (scores.T, scores[:, ::2], scores.to(torch.bfloat16), scores[0], scores.view(2, 4, 100)):
        assert torch.equal(ops.argmax(other), TORCH_SAMPLING.argmax(other))
    assert ops.argmax(torch.empty(0, 100)).shape == (0,)
    with pytest.raises((IndexError, RuntimeError)):  # as torch's max over an empty dimension
        ops.argmax(torch.empty(3, 0))


# ---- the top-k / top-p cut ---------------------------------------------------------------------


def weights_of(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return ((logits - logits.amax(dim=-1, keepdim=True)) / temperature).exp()


def kept_by_the_rule(logits: torch.Tensor, weights: torch.Tensor, k: int, p: float) -> set[int]:
    """The rule, token by token in float64: top-k keeps the k largest and ties with the k-th; top-p
    keeps a token of those when the mass strictly above its logit is below p of theirs."""
    values, mass = logits.tolist(), weights.double().tolist()
    kept = set(range(len(values)))
    if 0 < k < len(values):
        kth = sorted(values, reverse=True)[k - 1]
        kept = {i for i in kept if values[i] >= kth}
    if p < 1.0:
        total = sum(mass[i] for i in kept)
        kept = {i for i in kept if sum(mass[j] for j in kept if values[j] > values[i]) < p * total}
    return kept


def cases(
    vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[float]]:
    gen = torch.Generator().manual_seed(seed)
    spread = torch.randn(6, vocab, generator=gen) * torch.tensor([[0.3], [1.0], [3.0], [6.0], [1.0], [2.0]])
    tied = torch.randint(-3, 3, (6, vocab), generator=gen).float()  # few values: ties at every cut
    logits = torch.cat([spread, tied])
    temperatures = [0.7, 1.0, 1.3, 0.5, 2.0, 1.0] * 2
    weights = torch.cat([weights_of(logits[i : i + 1], t) for i, t in enumerate(temperatures)])
    top_k = torch.tensor([0, 1, 5, 40, vocab, vocab + 3, 0, 2, 0, 7, 1, 3])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 1e-6, 0.99, 0.9, 1.0, 0.6, 0.8, 0.4])
    return logits, weights, top_k, top_p, temperatures


@pytest.mark.parametrize(("vocab", "seed"), [(1, 0), (2, 1), (9, 2), (64, 3), (300, 4)])
def test_the_reference_cut_keeps_what_the_rule_keeps(vocab: int, seed: int) -> None:
    logits, weights, top_k, top_p, _ = cases(vocab, seed)
    cut = TORCH_SAMPLING.thresholds(logits, weights, top_k, top_p)
    for i in range(logits.shape[0]):
        kept = {j for j in range(vocab) if logits[i, j] >= cut[i]}
        assert kept == kept_by_the_rule(logits[i], weights[i], int(top_k[i]), float(top_p[i])), i
    # no cut: -inf
    none = TORCH_SAMPLING.thresholds(logits, weights, torch.zeros_like(top_k), torch.ones_like(top_p))
    assert bool((none == -INF).all())


@pytest.mark.parametrize(("vocab", "seed"), [(1, 0), (2, 1), (9, 2), (64, 3), (300, 4), (49152, 5)])
def test_the_c_cut_equals_the_reference(ops: CpuSamplingOps, threads: int, vocab: int, seed: int) -> None:
    logits, weights, top_k, top_p, _ = cases(vocab, seed)
    assert torch.equal(
        ops.thresholds(logits, weights, top_k, top_p),
        TORCH_SAMPLING.thresholds(logits, weights, top_k, top_p),
    )
    flat = torch.zeros(3, vocab)  # every token tied: each cut keeps them all
    flat_args = (flat, weights_of(flat, 1.0), torch.tensor([1, 0, 2]), torch.tensor([0.5, 0.1, 1.0]))
    assert torch.equal(ops.thresholds(*flat_args), TORCH_SAMPLING.thresholds(*flat_args))
    assert bool((ops.thresholds(*flat_args)[:2] == 0.0).all())


@pytest.mark.parametrize(("vocab", "seed"), [(2, 1), (64, 3), (49152, 5)])
def test_truncate_zeroes_the_weights_below_the_cut_alike(
    ops: CpuSamplingOps, threads: int, vocab: int, seed: int
) -> None:
    logits, weights, top_k, top_p, _ = cases(vocab, seed)
    cut = TORCH_SAMPLING.thresholds(logits, weights, top_k, top_p)
    by_c, by_torch = weights.clone(), weights.clone()
    ops.truncate(logits, by_c, top_k, top_p)
    TORCH_SAMPLING.truncate(logits, by_torch, top_k, top_p)
    assert torch.equal(by_c, by_torch)
    kept = logits >= cut.unsqueeze(1)
    assert torch.equal(by_c[kept], weights[kept]) and bool((by_c[~kept] == 0).all())
    assert bool(kept.any(dim=-1).all())  # the most likely token always stays


def test_a_mass_exactly_at_p_is_not_below_it(ops: CpuSamplingOps) -> None:
    """Four tokens of equal weight, p = 0.5: the third has exactly half the mass above it, not less."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    weights = torch.ones(2, 4)
    args = (logits, weights, torch.tensor([0, 0]), torch.tensor([0.5, 0.75]))
    assert TORCH_SAMPLING.thresholds(*args).tolist() == [2.0, 1.0]
    assert ops.thresholds(*args).tolist() == [2.0, 1.0]


def test_the_c_cut_gives_a_nan_row_none_and_takes_the_rest_to_the_reference(ops: CpuSamplingOps) -> None:
    logits, weights, top_k, top_p, _ = cases(50, 7)
    logits[3, 10] = NAN
    weights[3] = weights_of(logits[3:4], 1.0)[0]  # a NaN logit: its row's weights NaN
    assert bool(weights[3].isnan().any())
    got = ops.thresholds(logits, weights, top_k, top_p)
    assert got[3] == -INF
    keep = [i for i in range(logits.shape[0]) if i != 3]
    assert torch.equal(
        got[keep], TORCH_SAMPLING.thresholds(logits[keep], weights[keep], top_k[keep], top_p[keep])
    )
    strided = logits[:, ::2]
    assert torch.equal(
        ops.thresholds(strided, weights[:, ::2], top_k, top_p),
        TORCH_SAMPLING.thresholds(strided, weights[:, ::2], top_k, top_p),
    )
    with pytest.raises(ValueError, match="top_k, top_p"):
        ops.thresholds(logits, weights, top_k[:3], top_p)


def test_the_library_is_cached(tmp_path: Path) -> None:
    load_sampling_kernels(tmp_path)
    built = sorted(tmp_path.glob("sampling-*.so"))
    load_sampling_kernels(tmp_path)
    assert len(built) == 1 and sorted(tmp_path.glob("sampling-*.so")) == built


# ---- the race ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 7), (32, 1000), (32, 49152)])
def test_the_c_race_equals_the_reference(ops: CpuSamplingOps, threads: int, rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows + vocab)
    for temperature in (0.3, 1.0, 3.0):
        logits = torch.randn(rows, vocab, generator=gen) * 3
        weights = weights_of(logits, temperature)
        weights[weights < 1e-4] = 0.0  # as a cut leaves them: zeros are never drawn
        keys = torch.randint(0, 2**32, (rows,), generator=gen)
        got = ops.race(weights, keys)
        assert torch.equal(got, TORCH_SAMPLING.race(weights, keys))
        assert bool((weights.gather(1, got.unsqueeze(1)) > 0).all())


def test_the_race_draws_each_token_by_its_weight(ops: CpuSamplingOps) -> None:
    weights = torch.tensor([[0.25, 0.5, 0.75, 1.0, 0.0]]).expand(20_000, 5).contiguous()
    keys = torch.randint(0, 2**32, (20_000,), generator=torch.Generator().manual_seed(3))
    drawn = ops.race(weights, keys)
    for token, p in enumerate([0.1, 0.2, 0.3, 0.4, 0.0]):
        freq = float((drawn == token).float().mean())
        assert abs(freq - p) < 5 * (p * (1 - p) / 20_000) ** 0.5 + 1e-9, (token, freq)


def test_the_race_takes_a_nan_rows_first_nan_and_the_rest_to_the_reference(ops: CpuSamplingOps) -> None:
    weights = torch.rand(4, 50, generator=torch.Generator().manual_seed(4))
    weights[1, 7] = NAN
    weights[1, 30] = NAN
    keys = torch.tensor([1, 2, 3, 4])
    got = ops.race(weights, keys)
    assert got[1] == 7
    assert torch.equal(got, TORCH_SAMPLING.race(weights, keys))
    assert torch.equal(ops.race(weights[:, ::2], keys), TORCH_SAMPLING.race(weights[:, ::2], keys))
    with pytest.raises(ValueError, match="keys"):
        ops.race(weights, keys[:2])


def _key_whose_token_hashes_to(token: int, hashed: int) -> int:
    """The row key whose token ``token`` hashes to ``hashed`` (murmur3's finaliser undone)."""
    m = 0xFFFFFFFF
    x = hashed ^ (hashed >> 16)
    x = (x * pow(0xC2B2AE35, -1, 2**32)) & m
    x = x ^ (x >> 13) ^ (x >> 26)
    x = (x * pow(0x85EBCA6B, -1, 2**32)) & m
    x = x ^ (x >> 16)
    return x ^ ((token * 0x9E3779B9) & m)


@pytest.mark.parametrize("token", [0, 5, 49])
def test_the_race_uniforms_stay_inside_0_and_1_at_both_ends(ops: CpuSamplingOps, token: int) -> None:
    """The largest hash once made u exactly 1 (2^24 - 0.5 rounds to 2^24 in float32): an infinite
    score, a cut token (0 / 0) drawn by the reference and token 0 by C."""
    top, bottom = _key_whose_token_hashes_to(token, 0xFFFFFFFF), _key_whose_token_hashes_to(token, 0)
    u = race_uniforms(torch.tensor([top, bottom]), 50)
    assert u[0, token] == 1 - 2.0**-24 and u[1, token] == 2.0**-24
    assert bool(((u > 0) & (u < 1)).all())
    weights = torch.rand(2, 50, generator=torch.Generator().manual_seed(token)) + 0.1
    weights[0, token] = 0.0  # cut: never drawn, however large its noise
    keys = torch.tensor([top, bottom])
    got = ops.race(weights, keys)
    assert torch.equal(got, TORCH_SAMPLING.race(weights, keys))
    assert got[0] != token
