"""preemption.newest and preemption.lowest-tier: one of the candidates, the one each promises."""

from __future__ import annotations

from hypothesis import given

from policies.base import NoParams
from policies.preemption import LowestTier, Newest
from tests.policies.views import View, views
from tierserve.testing import SimConfig, SimRequest, simulate
from wire.tier import Tier


@given(views().filter(bool))
def test_newest_picks_a_latest_arrival(candidates: list[View]) -> None:
    victim = Newest(NoParams()).victim(candidates)
    assert any(victim is c for c in candidates)
    assert victim.arrival_time == max(c.arrival_time for c in candidates)


@given(views().filter(bool))
def test_lowest_tier_never_preempts_while_a_less_urgent_tier_runs(candidates: list[View]) -> None:
    victim = LowestTier(NoParams()).victim(candidates)
    assert any(victim is c for c in candidates)
    assert victim.tier_rank == max(c.tier_rank for c in candidates)
    same_tier = [c for c in candidates if c.tier_rank == victim.tier_rank]
    assert victim.num_computed_tokens == min(c.num_computed_tokens for c in same_tier)


def test_lowest_tier_examples() -> None:
    batch_far = View("batch-far", tier_rank=2, num_computed_tokens=900, arrival_time=0.0)
    batch_near = View("batch-near", tier_rank=2, num_computed_tokens=100, arrival_time=1.0)
    batch_near_new = View("batch-near-new", tier_rank=2, num_computed_tokens=100, arrival_time=2.0)
    interactive_new = View("interactive", tier_rank=0, num_computed_tokens=1, arrival_time=3.0)
    policy = LowestTier(NoParams())
    assert policy.victim([batch_far, interactive_new]) is batch_far
    assert policy.victim([batch_far, batch_near, interactive_new]) is batch_near
    assert policy.victim([batch_far, batch_near, batch_near_new, interactive_new]) is batch_near_new
    assert Newest(NoParams()).victim([batch_far, batch_near, interactive_new]) is interactive_new
    # Within a tier the largest priority value (vLLM's least urgent) goes first.
    batch_low = View("batch-low", tier_rank=2, num_computed_tokens=900, priority=5)
    assert policy.victim([batch_far, batch_near, batch_low, interactive_new]) is batch_low
    assert policy.victim([batch_low, View("standard", tier_rank=1, priority=99)]) is batch_low


def test_in_the_harness_the_victim_is_the_one_each_policy_picks() -> None:
    # The cache holds 60 tokens; the two requests need 50 together at first and 70 at the end.
    batch = SimRequest("batch", 0.0, Tier(name="batch", rank=2), num_prompt_tokens=20, num_output_tokens=15)
    urgent = SimRequest(
        "urgent", 0.0001, Tier(name="urgent", rank=0), num_prompt_tokens=20, num_output_tokens=15
    )
    config = SimConfig(kv_capacity_tokens=60)
    newest = simulate([batch, urgent], preemption=Newest(NoParams()), config=config)
    lowest = simulate([batch, urgent], preemption=LowestTier(NoParams()), config=config)
    for result in (newest, lowest):
        assert all(r.finished for r in result.requests.values())
    assert newest.requests["urgent"].num_preemptions > 0
    assert newest.requests["batch"].num_preemptions == 0
    assert lowest.requests["urgent"].num_preemptions == 0
    assert lowest.requests["batch"].num_preemptions > 0
