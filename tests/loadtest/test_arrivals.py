"""Arrival schedules: empirical rate and burstiness within tolerance, ramps, seeding."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from loadtest.arrivals import ArrivalKind, ArrivalSpec, arrival_offsets

N = 20_000


def schedule(spec: ArrivalSpec, n: int = N, seed: int = 0) -> list[float]:
    return list(itertools.islice(arrival_offsets(spec, seed), n))


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise([0.0, *times])]


def cv_squared(values: list[float]) -> float:
    return statistics.pvariance(values) / statistics.fmean(values) ** 2


def test_fixed_rate_is_evenly_spaced() -> None:
    times = schedule(ArrivalSpec(4.0, ArrivalKind.FIXED), n=9)
    assert times == pytest.approx([0.25 * (i + 1) for i in range(9)])


@pytest.mark.parametrize(
    ("kind", "burstiness", "expected_cv2"),
    [
        (ArrivalKind.POISSON, 1.0, 1.0),
        (ArrivalKind.GAMMA, 1.0, 1.0),  # gamma with shape 1 is Poisson
        (ArrivalKind.GAMMA, 0.25, 4.0),  # burstier
        (ArrivalKind.GAMMA, 4.0, 0.25),  # more even
    ],
)
def test_empirical_rate_and_burstiness(kind: ArrivalKind, burstiness: float, expected_cv2: float) -> None:
    times = schedule(ArrivalSpec(10.0, kind, burstiness))
    assert times == sorted(times)
    assert N / times[-1] == pytest.approx(10.0, rel=0.05)
    assert cv_squared(gaps(times)) == pytest.approx(expected_cv2, rel=0.1)


def test_seeded() -> None:
    spec = ArrivalSpec(5.0, ArrivalKind.GAMMA, 0.5)
    assert schedule(spec, 100, seed=3) == schedule(spec, 100, seed=3)
    assert schedule(spec, 100, seed=3) != schedule(spec, 100, seed=4)


def test_fixed_ramp_follows_the_cumulative_intensity() -> None:
    # 0 → 10 req/s over 100 s: Λ(t) = t²/20 up to t = 100 (Λ = 500), then 10 req/s.
    times = schedule(ArrivalSpec(10.0, ArrivalKind.FIXED, ramp_s=100.0), n=600)
    for k in (1, 50, 125, 500):
        assert times[k - 1] == pytest.approx(math.sqrt(20 * k))
    assert sum(t < 55 for t in times) == 151  # Λ(55) = 3025 / 20 = 151.25
    assert times[599] - times[499] == pytest.approx(100 / 10)  # the held rate after the ramp


def test_poisson_ramp_counts_within_tolerance() -> None:
    spec = ArrivalSpec(20.0, ArrivalKind.POISSON, ramp_s=200.0, ramp_from=5.0)
    times = schedule(spec, n=N)
    first_half = sum(t < 100 for t in times)  # Λ(100) = 5·100 + (15/400)·100² = 875
    ramp = sum(t < 200 for t in times)  # Λ(200) = 2500
    assert first_half == pytest.approx(875, rel=0.1)
    assert ramp == pytest.approx(2500, rel=0.06)
    after = [t for t in times if t >= 200]
    assert len(after) / (after[-1] - 200) == pytest.approx(20.0, rel=0.05)


def test_closed_loop_sends_everything_at_once() -> None:
    assert schedule(ArrivalSpec(None), n=5) == [0.0] * 5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rate": 0.0},
        {"rate": 1.0, "burstiness": 0.0},
        {"rate": None, "ramp_s": 5.0},
        {"rate": 1.0, "ramp_s": -1.0},
    ],
)
def test_bad_specs_are_refused(kwargs: dict[str, float | None]) -> None:
    with pytest.raises(ValueError):
        ArrivalSpec(**kwargs)  # type: ignore[arg-type]
