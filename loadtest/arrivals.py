"""When requests are sent: seeded arrival schedules, as offsets in seconds from the run's start.

Open loop (``rate`` set): the gaps between arrivals have mean 1/rate and are
  - ``fixed``:   exactly 1/rate;
  - ``poisson``: exponential (a Poisson process);
  - ``gamma``:   Gamma(shape=burstiness, scale=1/(rate·burstiness)), as vLLM's benchmark defines
                 ``--burstiness``: 1 is Poisson, below 1 burstier, above 1 more even (CV² = 1/burstiness).
A ramp makes the rate rise (or fall) linearly from ``ramp_from`` to ``rate`` over ``ramp_s`` seconds, then
hold: the same unit-mean gaps are laid out in the ramp's cumulative intensity Λ(t) = ∫ rate and mapped
back through Λ⁻¹ (the time-rescaling theorem), so a ramped Poisson schedule is still Poisson.

Closed loop (``rate`` None): every arrival is at 0; the runner's concurrency cap releases them one as
another finishes. Schedules are infinite iterators; the runner bounds them by count and duration.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum


class ArrivalKind(Enum):
    FIXED = "fixed"
    POISSON = "poisson"
    GAMMA = "gamma"


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    rate: float | None  # requests/s; None: closed loop
    kind: ArrivalKind = ArrivalKind.POISSON
    burstiness: float = 1.0  # gamma shape
    ramp_s: float = 0.0
    ramp_from: float = 0.0  # requests/s at t = 0 when ramping

    def __post_init__(self) -> None:
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.ramp_s < 0 or self.ramp_from < 0:
            raise ValueError("ramp_s and ramp_from must not be negative")
        if self.ramp_s > 0 and self.rate is None:
            raise ValueError("a ramp needs a rate (it is an open-loop schedule)")

    def describe(self) -> str:
        if self.rate is None:
            return "closed loop"
        text = f"{self.kind.value} at {self.rate:g} req/s"
        if self.kind is ArrivalKind.GAMMA:
            text += f", burstiness {self.burstiness:g}"
        if self.ramp_s > 0:
            text += f", ramped from {self.ramp_from:g} req/s over {self.ramp_s:g} s"
        return text


def arrival_offsets(spec: ArrivalSpec, seed: int) -> Iterator[float]:
    """Non-decreasing send times in seconds from the start, infinitely many."""
    if spec.rate is None:
        return itertools.repeat(0.0)
    return _open_loop(spec, spec.rate, random.Random(seed))


def _open_loop(spec: ArrivalSpec, rate: float, rng: random.Random) -> Iterator[float]:
    intensity = 0.0  # Λ: expected arrivals so far
    while True:
        intensity += _unit_gap(spec, rng)
        yield _time_at_intensity(intensity, rate, spec.ramp_from, spec.ramp_s)


def _unit_gap(spec: ArrivalSpec, rng: random.Random) -> float:
    """A gap of mean 1 in units of expected arrivals."""
    if spec.kind is ArrivalKind.FIXED:
        return 1.0
    if spec.kind is ArrivalKind.POISSON:
        return rng.expovariate(1.0)
    return rng.gammavariate(spec.burstiness, 1.0 / spec.burstiness)


def _time_at_intensity(intensity: float, rate: float, ramp_from: float, ramp_s: float) -> float:
    """Λ⁻¹: with rate(t) = r0 + (r1 - r0)·t/T on [0, T] and r1 after, Λ(t) = r0·t + a·t² (a = (r1-r0)/2T)
    up to T. The root of a·t² + r0·t - Λ = 0 is written 2Λ / (r0 + √(r0² + 4aΛ)): stable for a → 0."""
    if ramp_s <= 0:
        return intensity / rate
    ramp_intensity = (ramp_from + rate) / 2 * ramp_s  # Λ(T)
    if intensity >= ramp_intensity:
        return ramp_s + (intensity - ramp_intensity) / rate
    a = (rate - ramp_from) / (2 * ramp_s)
    return 2 * intensity / (ramp_from + math.sqrt(ramp_from**2 + 4 * a * intensity))
