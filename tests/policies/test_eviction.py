"""eviction.lru and eviction.priority-weighted, directly and through the eviction harness."""

from __future__ import annotations

from typing import ClassVar

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.base import EvictionCandidate, NoParams
from policies.eviction import Lru, PriorityWeighted, PriorityWeightedParams
from tierserve.testing import EvictionSim, PolicyContractError

candidates_st = st.lists(
    st.builds(EvictionCandidate, st.integers(0, 4), st.floats(0, 1000, allow_nan=False)),
    min_size=1,
    max_size=8,
)


@given(candidates_st)
def test_lru_picks_the_least_recently_used(candidates: list[EvictionCandidate]) -> None:
    index = Lru(NoParams()).choose(candidates, 2000.0)
    assert candidates[index].last_used == min(c.last_used for c in candidates)


@given(candidates_st, st.dictionaries(st.integers(0, 4), st.floats(0.1, 10)))
def test_priority_weighted_evicts_the_largest_weighted_age(
    candidates: list[EvictionCandidate], weights: dict[int, float]
) -> None:
    now = 2000.0
    index = PriorityWeighted(PriorityWeightedParams(weights=weights)).choose(candidates, now)
    assert 0 <= index < len(candidates)

    def age(c: EvictionCandidate) -> float:
        return (now - c.last_used) / weights.get(c.tier_rank, 1.0)

    assert age(candidates[index]) == max(age(c) for c in candidates)


def test_priority_weighted_default_weights_keep_an_interactive_block_four_times_as_long() -> None:
    policy = PriorityWeighted(PriorityWeightedParams())  # {0: 4, 1: 2, 2: 1}
    sim = EvictionSim(policy)
    sim.free("interactive", tier_rank=0, at=0.0)
    sim.free("batch", tier_rank=2, at=10.0)
    # At t=30 the interactive block is 30 s idle (weighted 7.5), the batch one 20 s (weighted 20).
    assert sim.evict(now=30.0) == "batch"
    sim.free("batch-2", tier_rank=2, at=35.0)
    # At t=45: interactive 45/4 = 11.25 > batch 10/1 = 10: now it goes, though batch-2 is newer ...
    assert sim.evict(now=45.0) == "interactive"
    assert len(sim) == 1


def test_lru_ignores_the_tier_and_priority_weighted_with_equal_weights_is_lru() -> None:
    for policy in (Lru(NoParams()), PriorityWeighted(PriorityWeightedParams(weights={0: 1.0, 2: 1.0}))):
        sim = EvictionSim(policy)
        sim.free("interactive", tier_rank=0, at=0.0)
        sim.free("batch", tier_rank=2, at=10.0)
        assert [sim.evict(now=30.0), sim.evict(now=30.0)] == ["interactive", "batch"]


def test_within_a_tier_the_oldest_free_block_goes_first_and_reused_blocks_are_not_candidates() -> None:
    sim = EvictionSim(PriorityWeighted(PriorityWeightedParams()))
    for i, at in enumerate((5.0, 1.0, 3.0)):
        sim.free(f"b{i}", tier_rank=1, at=at)
    sim.reuse("b1")  # a prefix hit took the oldest back: it is running again
    assert [c.last_used for c, _ in sim.candidates()] == [3.0]
    assert [sim.evict(10.0), sim.evict(10.0)] == ["b2", "b0"]
    with pytest.raises(ValueError, match="no free block"):
        sim.evict(10.0)


def test_weights_must_be_positive() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"weights": {"0": 0.0}}, PriorityWeightedParams, strict=False)


def test_the_harness_refuses_an_index_out_of_range() -> None:
    class Broken:
        kind: ClassVar[str] = "eviction"

        def choose(self, candidates: object, now: float) -> int:
            return 5

    sim = EvictionSim(Broken())
    sim.free("b", tier_rank=0, at=0.0)
    with pytest.raises(PolicyContractError, match=r"Broken\.choose returned 5 for 1 candidates"):
        sim.evict(1.0)
