"""ordering.fcfs and ordering.tiered: permutations, and the order each one promises."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from policies.base import NoParams, OrderingPolicy
from policies.ordering import Fcfs, Tiered
from tests.policies.views import View, ids, views
from tierserve.testing import SimConfig, SimRequest, simulate
from wire.tier import Tier

ORDERINGS: list[OrderingPolicy] = [Fcfs(NoParams()), Tiered(NoParams())]


@given(views(), st.sampled_from(ORDERINGS), st.floats(0, 1000))
def test_order_is_a_permutation(requests: list[View], policy: OrderingPolicy, now: float) -> None:
    ordered = policy.order(requests, now)
    assert sorted(ids(ordered)) == sorted(ids(requests))
    assert len(ordered) == len(requests)


@given(views())
def test_fcfs_orders_by_arrival_whatever_the_tier(requests: list[View]) -> None:
    arrivals = [r.arrival_time for r in Fcfs(NoParams()).order(requests, 0.0)]
    assert arrivals == sorted(arrivals)


def test_fcfs_example() -> None:
    requests = [View("b", tier_rank=2, arrival_time=1.0), View("i", tier_rank=0, arrival_time=2.0)]
    assert ids(Fcfs(NoParams()).order(requests, 0.0)) == ["b", "i"]


@given(views())
def test_tiered_never_puts_a_less_urgent_tier_first(requests: list[View]) -> None:
    ranks = [r.tier_rank for r in Tiered(NoParams()).order(requests, 0.0)]
    assert ranks == sorted(ranks)


@given(views())
def test_tiered_orders_by_ttft_deadline_within_a_tier_none_last(requests: list[View]) -> None:
    ordered = Tiered(NoParams()).order(requests, 0.0)
    for before, after in itertools.pairwise(ordered):
        if before.tier_rank != after.tier_rank:
            continue
        if before.ttft_deadline is None:
            assert after.ttft_deadline is None  # no deadline sorts after every deadline
            assert before.arrival_time <= after.arrival_time
        elif after.ttft_deadline is not None:
            assert (before.ttft_deadline, before.arrival_time) <= (after.ttft_deadline, after.arrival_time)


def test_tiered_example() -> None:
    requests = [
        View("batch-old", tier_rank=2, arrival_time=0.0),
        View("std-late-deadline", tier_rank=1, ttft_deadline=9.0, arrival_time=1.0),
        View("std-early-deadline", tier_rank=1, ttft_deadline=5.0, arrival_time=2.0),
        View("std-no-deadline", tier_rank=1, arrival_time=0.5),
        View("interactive", tier_rank=0, ttft_deadline=20.0, arrival_time=3.0),
    ]
    assert ids(Tiered(NoParams()).order(requests, 0.0)) == [
        "interactive",
        "std-early-deadline",
        "std-late-deadline",
        "std-no-deadline",
        "batch-old",
    ]


def test_in_the_harness_tiered_gives_the_urgent_tier_its_first_token_sooner() -> None:
    urgent = Tier(name="urgent", rank=0, ttft_ms=500.0)
    bulk = Tier(name="bulk", rank=1)
    # 20 bulk requests queue first; one urgent request arrives behind them. One sequence at a time.
    requests = [SimRequest(f"b{i}", 0.0, bulk, 64, 8) for i in range(20)]
    requests.append(SimRequest("u", 0.001, urgent, 64, 8))
    config = SimConfig(max_num_seqs=1)
    fcfs = simulate(requests, ordering=Fcfs(NoParams()), config=config).requests["u"]
    tiered = simulate(requests, ordering=Tiered(NoParams()), config=config).requests["u"]
    assert tiered.ttft_ms is not None and fcfs.ttft_ms is not None
    assert tiered.meets_slo and not fcfs.meets_slo
    assert tiered.ttft_ms * 5 < fcfs.ttft_ms
