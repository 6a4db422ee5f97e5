"""Built-in orderings: ``fcfs`` (the baseline) and ``tiered``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from policies.base import NoParams, SeqView


class Fcfs:
    """First come, first served: by arrival time, whatever the tier."""

    kind: ClassVar[str] = "ordering"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        pass

    def order(self, requests: Sequence[SeqView], now: float) -> list[SeqView]:
        return sorted(requests, key=lambda r: r.arrival_time)


class Tiered:
    """Most urgent tier first (lowest rank); within a tier the earliest TTFT deadline, then arrival.

    Invariant beyond the Protocol's: a request never comes after one of a less urgent tier.
    """

    kind: ClassVar[str] = "ordering"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        pass

    def order(self, requests: Sequence[SeqView], now: float) -> list[SeqView]:
        def key(r: SeqView) -> tuple[int, float, float]:
            deadline = r.ttft_deadline
            return (r.tier_rank, math.inf if deadline is None else deadline, r.arrival_time)

        return sorted(requests, key=key)
