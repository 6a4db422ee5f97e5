"""Built-in eviction among free cached blocks: ``lru`` (the baseline) and ``priority-weighted``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from policies.base import EvictionCandidate, NoParams


class Lru:
    """The block unused for longest, whatever tier last used it."""

    kind: ClassVar[str] = "eviction"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        pass

    def choose(self, candidates: Sequence[EvictionCandidate], now: float) -> int:
        return min(range(len(candidates)), key=lambda i: candidates[i].last_used)


class PriorityWeightedParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Weight per tier rank: a block last used by rank r ages 1/weight[r] times as fast. Ranks not
    # listed weigh 1. The defaults keep an interactive prefix four times as long as a batch one.
    weights: dict[int, Annotated[float, msgspec.Meta(gt=0)]] = msgspec.field(
        default_factory=lambda: {0: 4.0, 1: 2.0, 2: 1.0}
    )


class PriorityWeighted:
    """Evict the candidate with the largest weighted age ``(now - last_used) / weight[tier_rank]``.

    Invariant: among blocks of one tier this is LRU; a block of a more heavily weighted tier is evicted
    before a lighter one only once it has been idle ``weight`` times as long.
    """

    kind: ClassVar[str] = "eviction"
    Params = PriorityWeightedParams

    def __init__(self, params: PriorityWeightedParams) -> None:
        self.weights = dict(params.weights)

    def choose(self, candidates: Sequence[EvictionCandidate], now: float) -> int:
        def age(i: int) -> float:
            c = candidates[i]
            return (now - c.last_used) / self.weights.get(c.tier_rank, 1.0)

        return max(range(len(candidates)), key=age)
