"""ordering.fcfs and ordering.tiered: permutations, the order each one promises, tenant fairness."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.base import NoParams, OrderingPolicy, SeqView
from policies.ordering import Fcfs, Tiered, TieredParams
from tests.policies.views import View, ids, views
from tierserve.testing import SimConfig, SimRequest, simulate
from wire.tier import DEFAULT_TIERS, Tier

STANDARD = DEFAULT_TIERS[1]

ORDERINGS: list[OrderingPolicy] = [Fcfs(NoParams()), Tiered(TieredParams())]


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
    ranks = [r.tier_rank for r in Tiered(TieredParams()).order(requests, 0.0)]
    assert ranks == sorted(ranks)


@given(views())
def test_tiered_orders_by_ttft_deadline_within_a_tenant_of_a_tier_none_last(requests: list[View]) -> None:
    ordered = Tiered(TieredParams()).order(requests, 0.0)
    for tenant in {r.tenant for r in requests}:
        _assert_deadline_order([r for r in ordered if r.tenant == tenant])


def _assert_deadline_order(ordered: Sequence[SeqView]) -> None:
    for before, after in itertools.pairwise(ordered):
        if (before.tier_rank, before.priority) != (after.tier_rank, after.priority):
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
    assert ids(Tiered(TieredParams()).order(requests, 0.0)) == [
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
    tiered = simulate(requests, ordering=Tiered(TieredParams()), config=config).requests["u"]
    assert tiered.ttft_ms is not None and fcfs.ttft_ms is not None
    assert tiered.meets_slo and not fcfs.meets_slo
    assert tiered.ttft_ms * 5 < fcfs.ttft_ms


# ---------------------------------------------------------------- tiered: priority and tenants


@st.composite
def prioritised(draw: st.DrawFn) -> list[View]:
    """``views()`` with priorities drawn."""
    return [replace(r, priority=draw(st.integers(-2, 2))) for r in draw(views())]


def urgency_order(requests: list[View]) -> list[str]:
    """Today's tiered order with priority: (tier, priority, deadline (None last), arrival)."""
    return ids(
        sorted(
            requests,
            key=lambda r: (
                r.tier_rank,
                r.priority,
                math.inf if r.ttft_deadline is None else r.ttft_deadline,
                r.arrival_time,
            ),
        )
    )


@given(prioritised())
def test_tiered_never_puts_a_higher_priority_first_within_a_tier(requests: list[View]) -> None:
    ordered = Tiered(TieredParams()).order(requests, 0.0)
    assert [(r.tier_rank, r.priority) for r in ordered] == sorted((r.tier_rank, r.priority) for r in ordered)


@given(prioritised(), st.sampled_from([None, "only"]), st.integers(0, 64))
def test_with_one_tenant_tiered_is_the_urgency_order_exactly(
    requests: list[View], tenant: str | None, progress: int
) -> None:
    requests = [replace(r, tenant=tenant) for r in requests]
    policy = Tiered(TieredParams())
    assert ids(policy.order(requests, 0.0)) == urgency_order(requests)
    # Again once the tenant has been charged for some progress: still the same order.
    later = [
        replace(r, num_computed_tokens=min(r.num_tokens, r.num_computed_tokens + progress)) for r in requests
    ]
    assert ids(policy.order(later, 1.0)) == urgency_order(later)


@given(prioritised())
def test_with_both_weights_zero_tiered_is_the_urgency_order_whatever_the_tenants(
    requests: list[View],
) -> None:
    policy = Tiered(TieredParams(input_weight=0.0, output_weight=0.0))
    assert ids(policy.order(requests, 0.0)) == urgency_order(requests)


def test_the_tenant_with_less_service_goes_first_within_a_tier() -> None:
    policy = Tiered(TieredParams())
    heavy = View("h1", tenant="heavy", num_prompt_tokens=100, arrival_time=0.0, ttft_deadline=3.0)
    light = View("l1", tenant="light", num_prompt_tokens=100, arrival_time=5.0, ttft_deadline=8.0)
    assert ids(policy.order([heavy, light], 0.0)) == ["h1", "l1"]  # equal counters: the deadline
    heavy = replace(heavy, num_computed_tokens=100, num_output_tokens=1)  # 99 + 2 served
    light = replace(light, num_computed_tokens=40)  # a prefill chunk: 40 served
    assert ids(policy.order([heavy, light], 1.0)) == ["l1", "h1"]
    assert policy.service.counter("heavy") == pytest.approx(101.0)
    assert policy.service.counter("light") == pytest.approx(40.0)


def test_one_tenants_many_requests_interleave_with_anothers_by_tentative_charge() -> None:
    policy = Tiered(TieredParams())
    # a's decodes cost 2 each this step, b's waiting prompt of 5 costs 4 + 2: a0 and b0 tie at 0 (a0's
    # deadline is earlier), then a1 (2), a2 (4), a3 (6) vs b1 (6): a3's deadline first, then b1.
    a = [
        View(f"a{i}", tenant="a", num_prompt_tokens=4, num_computed_tokens=4, ttft_deadline=i)
        for i in range(5)
    ]
    b = [View(f"b{i}", tenant="b", num_prompt_tokens=5, ttft_deadline=10.0 + i) for i in range(2)]
    assert ids(policy.order([*b, *a], 0.0)) == ["a0", "b0", "a1", "a2", "a3", "b1", "a4"]


def test_fairness_never_crosses_a_tier_or_a_priority() -> None:
    policy = Tiered(TieredParams())
    heavy = [View(f"h{i}", tenant="heavy", tier_rank=0) for i in range(3)]
    light_low = View("light-p1", tenant="light", tier_rank=0, priority=1)
    light_batch = View("light-batch", tenant="light", tier_rank=2, priority=-5)
    policy.order([*heavy, light_low, light_batch], 0.0)
    heavy = [replace(h, num_computed_tokens=16) for h in heavy]  # heavy has been served, light not
    assert ids(policy.order([light_batch, light_low, *heavy], 1.0)) == [
        "h0",
        "h1",
        "h2",
        "light-p1",
        "light-batch",
    ]


def test_in_the_harness_a_heavy_tenants_flood_does_not_queue_a_light_one_of_its_tier() -> None:
    # One tier; "heavy" sends ten times light's rate, together well past capacity.
    heavy = [SimRequest(f"h{i}", i * 0.05, STANDARD, 256, 32, tenant="heavy") for i in range(400)]
    light = [SimRequest(f"l{i}", 0.3 + i * 0.5, STANDARD, 256, 32, tenant="light") for i in range(40)]
    config = SimConfig(max_num_batched_tokens=512, max_num_seqs=16)

    def light_ttfts(requests: list[SimRequest], params: TieredParams) -> list[float]:
        result = simulate(requests, ordering=Tiered(params), config=config)
        assert all(r.finished for r in result.requests.values())
        return [r.ttft_ms for r in result.requests.values() if r.tenant == "light" and r.ttft_ms is not None]

    fair = light_ttfts(heavy + light, TieredParams())
    unfair = light_ttfts(heavy + light, TieredParams(input_weight=0.0, output_weight=0.0))
    alone = light_ttfts(light, TieredParams())
    # Fairness off, light queues behind the flood (median 27 s); on, it takes a slot of heavy's at
    # once and shares the flood's fuller steps (static budget: up to 512 tokens each) (median 0.29 s,
    # worst 0.53 s, against 0.14 s alone; without slot sharing it waited for a slot: 0.38 s, 0.72 s).
    assert statistics.median(fair) * 50 < statistics.median(unfair), (fair, unfair)
    assert max(fair) < 4.5 * max(alone), (max(fair), max(alone))


def slot_view(request_id: str, tenant: str, tier_rank: int = 1) -> View:
    return View(request_id, tenant=tenant, tier_rank=tier_rank, num_computed_tokens=16, num_output_tokens=1)


def test_a_tenant_under_its_share_of_slots_may_take_one_from_a_tenant_over_it() -> None:
    policy = Tiered(TieredParams())
    heavy = [slot_view(f"h{i}", "heavy") for i in range(8)]
    light = View("l0", tenant="light")
    assert ids(policy.slot_donors(light, heavy, [light], 8)) == ids(heavy)
    # Four each: at their shares, nobody gives way (and a second heavy arrival takes nothing either).
    even = heavy[:4] + [slot_view(f"l{i}", "light") for i in range(1, 5)]
    assert policy.slot_donors(light, even, [light], 8) == []
    assert policy.slot_donors(View("h9", tenant="heavy"), even, [], 8) == []
    # Three tenants, eight slots (2.67 each): light holding one may take a second from heavy's five,
    # not from other's two; holding two it waits.
    others = [slot_view("o1", "other"), slot_view("o2", "other")]
    mixed = [*heavy[:5], *others, slot_view("l1", "light")]
    assert ids(policy.slot_donors(light, mixed, [], 8)) == ids(heavy[:5])
    mixed = [*heavy[:4], *others, slot_view("l1", "light"), slot_view("l2", "light")]
    assert policy.slot_donors(light, mixed, [], 8) == []
    # Another tier's slots are not this tier's to share; fairness off shares nothing.
    urgent = [slot_view(f"u{i}", "heavy", tier_rank=0) for i in range(4)]
    assert ids(policy.slot_donors(light, [*urgent, *heavy[:4]], [], 8)) == ids(heavy[:4])
    off = Tiered(TieredParams(input_weight=0.0, output_weight=0.0))
    assert off.slot_donors(light, heavy, [light], 8) == []


@given(
    st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=12),
    st.lists(st.sampled_from(["a", "b", "c"]), max_size=4),
    st.integers(1, 12),
)
def test_a_slot_taken_is_never_taken_back(running: list[str], waiting: list[str], max_seqs: int) -> None:
    policy = Tiered(TieredParams())
    views = [slot_view(f"r{i}", t) for i, t in enumerate(running[:max_seqs])]
    queued = [View(f"w{i}", tenant=t) for i, t in enumerate(waiting)]
    for taker in queued:
        for donor in policy.slot_donors(taker, views, queued, max_seqs):
            assert donor.tenant != taker.tenant
            # Swap them: the donor waits, the taker runs. The donor's claim names none of taker's tenant.
            after = [v for v in views if v is not donor] + [slot_view(taker.request_id, str(taker.tenant))]
            back = View(donor.request_id, tenant=donor.tenant)
            rest = [q for q in queued if q is not taker] + [back]
            assert all(d.tenant != taker.tenant for d in policy.slot_donors(back, after, rest, max_seqs))
