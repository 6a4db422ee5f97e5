"""budget.static and budget.slo-budget: within the limits, and slo-budget keeps the strictest TPOT."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.base import NoParams, StepLimits, StepReport
from policies.budget import SloBudget, SloBudgetParams, Static
from policies.ordering import Fcfs, Tiered, TieredParams
from policies.preemption import LowestTier, Newest
from policies.step_time import StepCost
from tests.policies.views import View, views
from tierserve.testing import CostModel, SimConfig, SimRequest, SimResult, poisson_workload, simulate
from wire.tier import DEFAULT_TIERS

INTERACTIVE, STANDARD, BATCH = DEFAULT_TIERS
limits_st = st.builds(StepLimits, st.integers(1, 8192), st.integers(1, 256), st.floats(0, 2000))
reports_st = st.lists(
    st.builds(
        StepReport,
        st.integers(0, 8192),
        st.integers(0, 256),
        st.integers(0, 10**6),
        st.floats(0, 1e5, allow_nan=False, allow_infinity=False),
    ),
    max_size=20,
)


@given(views(), views(), limits_st)
def test_static_is_the_limits(running: list[View], waiting: list[View], limits: StepLimits) -> None:
    budget = Static(NoParams()).budget(running, waiting, limits)
    assert (budget.max_num_tokens, budget.max_num_seqs) == (
        limits.max_num_batched_tokens,
        limits.max_num_seqs,
    )


@given(views(), views(), limits_st, st.floats(0.05, 1.0), st.floats(1.0, 4.0), reports_st)
def test_slo_budget_keeps_the_limits_and_every_stream_s_time_in_hand(
    running: list[View],
    waiting: list[View],
    limits: StepLimits,
    safety: float,
    factor: float,
    reports: list[StepReport],
) -> None:
    # Tenant isolation off: its cap only shortens steps (the next test).
    policy = SloBudget(SloBudgetParams(safety=safety, min_step_factor=factor, shared_step_factor=0.0))
    for report in reports:  # whatever it has learnt
        policy.observe(report)
    budget = policy.budget(running, waiting, limits)
    assert (budget.max_num_tokens, budget.max_num_seqs) == (
        limits.max_num_batched_tokens,
        limits.max_num_seqs,
    )
    floor = factor * policy.model.cost.floor_ms
    targets = [r.tpot_ms for r in (*running, *waiting) if r.tpot_ms is not None]
    if not targets:
        ttfts = [
            r.ttft_deadline - r.arrival_time for r in (*running, *waiting) if r.ttft_deadline is not None
        ]
        # batch work in pieces of a fifth of the strictest TTFT (1 s assumed until one is seen)
        assert budget.time_limit is not None
        strictest = min(ttfts) * 1e3 if ttfts else 1000.0
        assert budget.time_limit.max_ms == pytest.approx(max(floor, 0.2 * strictest))
        return
    assert budget.time_limit is not None
    max_ms = budget.time_limit.max_ms
    assert max_ms >= floor - 1e-9  # never cut below what a step needs
    streams = [r for r in running if r.tpot_ms is not None and r.first_token_time is not None]
    in_hand = policy.time_in_hand_ms(streams, limits.now)
    assert max_ms <= max(floor, in_hand) + 1e-9  # every running stream keeps its TPOT, when it can
    assert max_ms >= min(safety * min(targets), in_hand) - 1e-9  # and the target's allowance is kept


@given(views(), views(), limits_st, reports_st)
def test_tenant_isolation_only_shortens_steps(
    running: list[View], waiting: list[View], limits: StepLimits, reports: list[StepReport]
) -> None:
    isolating, plain = SloBudget(SloBudgetParams()), SloBudget(SloBudgetParams(shared_step_factor=0.0))
    for report in reports:
        isolating.observe(report)
        plain.observe(report)
    on = isolating.budget(running, waiting, limits).time_limit
    off = plain.budget(running, waiting, limits).time_limit
    tiers = {r.tier_rank for r in (*running, *waiting)}
    shared = any(len({r.tenant for r in (*running, *waiting) if r.tier_rank == t}) > 1 for t in tiers)
    if not shared:
        assert on == off
        return
    assert on is not None
    floor = 2.0 * isolating.model.cost.floor_ms
    assert floor - 1e-9 <= on.max_ms <= (math.inf if off is None else max(off.max_ms, floor)) + 1e-9
    for request_id, ms in on.first_token_ms.items():  # a first token's ceiling is never raised
        assert ms > on.max_ms
        if off is not None:
            assert ms <= off.first_token_ms.get(request_id, off.max_ms) + 1e-9


def test_a_shared_tier_caps_the_steps_of_the_tenant_over_its_share() -> None:
    # Costs: fixed 10, decode 1, prefill 2 per token. Heavy holds all 8 slots (its streams well
    # within their 200 ms target) and waits with more; light arrives with a 100-token prompt.
    params = SloBudgetParams(
        fixed_ms=10.0, per_decode_ms=1.0, per_prefill_token_ms=2.0, per_context_token_ms=0.0
    )
    heavy = [
        View(f"h{i}", tpot_ms=200.0, first_token_time=10.0, num_output_tokens=4, tenant="heavy")
        for i in range(8)
    ]
    more_heavy = View(
        "hw", tpot_ms=200.0, ttft_deadline=13.0, arrival_time=10.0, num_prompt_tokens=200, tenant="heavy"
    )
    light = replace(more_heavy, request_id="l", num_prompt_tokens=100, tenant="light")
    limits = StepLimits(4096, 8, now=10.0)
    policy = SloBudget(params)
    alone = policy.budget(heavy, [more_heavy], limits).time_limit
    # heavy alone: 0.8 · 200 ms, and its next prompt in one step beside the decodes (10 + 8 + 400)
    assert alone is not None and alone.max_ms == pytest.approx(160.0)
    assert alone.first_token_ms == {"hw": pytest.approx(418.0)}
    shared = policy.budget(heavy, [more_heavy, light], limits).time_limit
    # Two tenants: the decode step (18 ms) and max(1 · 18, a 32-token chunk: 64) more, 82 ms;
    # heavy's prompt within that, light's whole prompt beside the decodes (10 + 8 + 200).
    assert shared is not None and shared.max_ms == pytest.approx(82.0)
    assert shared.first_token_ms == {"l": pytest.approx(218.0)}
    # The tier stays shared for shared_window_s after light's last request, then it is heavy's.
    later = StepLimits(4096, 8, now=39.0)
    limit = policy.budget(heavy, [more_heavy], later).time_limit
    assert limit is not None and limit.max_ms == pytest.approx(82.0)
    limit = policy.budget(heavy, [more_heavy], StepLimits(4096, 8, now=40.5)).time_limit
    assert limit is not None and limit.max_ms == pytest.approx(160.0)


def test_a_light_tenant_s_first_token_does_not_wait_out_a_flooding_tenant_s_prefill() -> None:
    # About this repo's Zen 5 VM on the Q4_1 model: a prefill token 0.6 ms, a decode 1 ms, fixed 8.
    # Heavy floods with 200 requests at once (8 slots); light sends one 100-token prompt a second.
    cost = CostModel(fixed_ms=8.0, per_token_ms=0.6, per_decode_ms=1.0, per_context_token_ms=0.0)
    rng = random.Random(3)
    heavy = [
        SimRequest(f"h{i}", 0.0, STANDARD, rng.randint(32, 256), rng.randint(32, 64), tenant="heavy")
        for i in range(200)
    ]
    light = [
        SimRequest(f"l{i}", 1.0 + i + rng.random() * 0.5, STANDARD, 100, 20, tenant="light")
        for i in range(20)
    ]
    priors = {"fixed_ms": 8.0, "per_decode_ms": 1.0, "per_prefill_token_ms": 0.6, "per_context_token_ms": 0.0}

    def run(shared_step_factor: float, requests: list[SimRequest]) -> SimResult:
        budget = SloBudget(SloBudgetParams(shared_step_factor=shared_step_factor, **priors))
        config = SimConfig(cost=cost, max_num_seqs=8, max_time_s=25.0)
        return simulate(requests, ordering=Tiered(TieredParams()), budget=budget, config=config)

    def light_ttft_ms(result: SimResult) -> list[float]:
        return sorted(
            (result.requests[r.request_id].token_times[0] - r.arrival_time) * 1e3
            for r in light
            if result.requests[r.request_id].token_times
        )

    alone = max(light_ttft_ms(run(2.0, light)))  # 8 + 60 ms
    isolated, plain = run(2.0, [*heavy, *light]), run(0.0, [*heavy, *light])
    assert len(light_ttft_ms(isolated)) == len(light) == len(light_ttft_ms(plain))
    # Without the cap light waits out heavy's prefill steps (up to 0.8 · 200 ms); with it, at most a
    # step of heavy's decodes and a 32-token chunk, then its prompt beside the decodes.
    assert max(light_ttft_ms(plain)) > 2 * alone
    assert max(light_ttft_ms(isolated)) < 1.6 * alone
    # heavy pays little for it: its prompts come in chunks beside decodes that run anyway
    assert isolated.throughput_tok_s >= 0.9 * plain.throughput_tok_s


def test_slo_budget_aims_at_the_strictest_target_and_never_below_twice_the_floor() -> None:
    params = SloBudgetParams(safety=0.8, fixed_ms=10.0, per_decode_ms=1.0)
    policy = SloBudget(params)
    limits = StepLimits(4096, 64, now=0.0)
    running = [View("r", tpot_ms=100.0)]
    limit = policy.budget(running, [View("w", tpot_ms=50.0)], limits).time_limit
    assert limit is not None and limit.max_ms == pytest.approx(40.0)  # waiting requests count
    assert limit.cost == StepCost(10.0, 1.0, params.per_prefill_token_ms, params.per_context_token_ms)
    # A target this machine cannot meet even alone: steps of twice the one-decode step (22 ms).
    limit = policy.budget([View("r", tpot_ms=5.0)], [], limits).time_limit
    assert limit is not None and limit.max_ms == pytest.approx(2 * 11.0)


def test_a_due_first_token_gets_one_long_step_when_the_streams_have_time_in_hand() -> None:
    # Costs: fixed 10, decode 1, prefill 0.5 per token, no context term.
    params = SloBudgetParams(safety=0.8, fixed_ms=10.0, per_decode_ms=1.0, per_context_token_ms=0.0)
    policy = SloBudget(params)
    prompt = View(
        "p", tier_rank=0, tpot_ms=100.0, ttft_deadline=11.0, arrival_time=10.0, num_prompt_tokens=400
    )
    # A stream 10 tokens in, 0.5 s after its first token: 0.8 · 100 · 10 − 500 = 300 ms in hand.
    stream = View("s", tier_rank=0, tpot_ms=100.0, first_token_time=10.0, num_output_tokens=10)
    limit = policy.budget([stream], [prompt], StepLimits(4096, 64, now=10.5)).time_limit
    # the whole prompt beside the stream's decode: 10 + 1 + 0.5 · 400 = 211 ms, within the 300; the
    # lengthening is the prompt's alone (anyone else's tokens stay within the 80 ms step).
    assert limit is not None and limit.max_ms == pytest.approx(80.0)
    assert limit.first_token_ms == {"p": pytest.approx(211.0)}
    # A stream that has just started has 80 ms in hand: the prompt is chunked within it.
    fresh = View("f", tier_rank=0, tpot_ms=100.0, first_token_time=10.5, num_output_tokens=1)
    limit = policy.budget([stream, fresh], [prompt], StepLimits(4096, 64, now=10.5)).time_limit
    assert limit is not None and limit.max_ms == pytest.approx(80.0) and not limit.first_token_ms
    # Late but alone (no stream to hold back): the prompt still gets its one step (10 + 0.5 · 400).
    limit = policy.budget([], [prompt], StepLimits(4096, 64, now=11.2)).time_limit
    assert limit is not None and limit.first_token_ms == {"p": pytest.approx(210.0)}
    # A stream behind its target asks for no less than 0.8 · 100 = 80 ms (catch_up_fraction 1): shorter
    # steps would pay the fixed part for fewer tokens, and on a loaded worker everyone falls further
    # behind; with catch_up_fraction 0.5, steps of 40 ms while it catches up.
    late = View("l", tier_rank=0, tpot_ms=100.0, first_token_time=9.0, num_output_tokens=5)
    limit = policy.budget([late], [], StepLimits(4096, 64, now=10.5)).time_limit
    assert limit is not None and limit.max_ms == pytest.approx(80.0)
    halving = SloBudget(msgspec.structs.replace(params, catch_up_fraction=0.5))
    limit = halving.budget([late], [], StepLimits(4096, 64, now=10.5)).time_limit
    assert limit is not None and limit.max_ms == pytest.approx(40.0)
    # Past the prompt's TTFT deadline (11.0) one long step saves nothing: 80 ms steps, it chunked
    # (a stream 20 tokens in, 1.2 s after its first, has 400 ms in hand).
    ahead = replace(stream, num_output_tokens=20)
    limit = policy.budget([ahead], [prompt], StepLimits(4096, 64, now=11.2)).time_limit
    assert limit is not None and limit.max_ms == pytest.approx(80.0) and not limit.first_token_ms
    # Late but alone (no stream to hold back): the prompt still gets its one step (10 + 0.5 · 400).
    limit = policy.budget([], [prompt], StepLimits(4096, 64, now=11.2)).time_limit
    assert limit is not None and limit.first_token_ms == {"p": pytest.approx(210.0)}


def test_a_first_token_always_may_have_a_minimal_chunk_beside_streams_with_little_in_hand() -> None:
    # A slow prefill (4 ms a token): a 16-token chunk beside one decode is 10 + 1 + 64 = 75 ms, more
    # than the 40 ms a stream behind its target leaves; the prompt may have that chunk anyway, each
    # step (late or due), rather than wait for every stream to end.
    params = SloBudgetParams(
        safety=0.8,
        catch_up_fraction=0.5,
        fixed_ms=10.0,
        per_decode_ms=1.0,
        per_prefill_token_ms=4.0,
        per_context_token_ms=0.0,
    )
    policy = SloBudget(params)
    behind = View("s", tier_rank=0, tpot_ms=100.0, first_token_time=9.0, num_output_tokens=5)
    prompt = View(
        "p", tier_rank=0, tpot_ms=100.0, ttft_deadline=11.0, arrival_time=10.0, num_prompt_tokens=400
    )
    limit = policy.budget([behind], [prompt], StepLimits(4096, 64, now=11.2)).time_limit
    assert limit is not None and limit.max_ms == pytest.approx(40.0)
    assert limit.first_token_ms == {"p": pytest.approx(75.0)}
    # Still due, it may have no less.
    limit = policy.budget([behind], [prompt], StepLimits(4096, 64, now=10.5)).time_limit
    assert limit is not None and limit.first_token_ms == {"p": pytest.approx(75.0)}


def test_a_tenant_ahead_in_slots_does_not_hold_back_the_first_token_of_one_behind() -> None:
    # Costs: fixed 10, decode 1, prefill 4 per token. Heavy holds 7 of 8 slots, its streams behind
    # their 200 ms target: 0.5 · 0.8 · 200 = 80 ms in hand (catch_up_fraction 0.5).
    params = SloBudgetParams(
        safety=0.8,
        catch_up_fraction=0.5,
        fixed_ms=10.0,
        per_decode_ms=1.0,
        per_prefill_token_ms=4.0,
        per_context_token_ms=0.0,
    )
    heavy = [
        View(f"h{i}", tpot_ms=200.0, first_token_time=0.0, num_output_tokens=2, tenant="heavy")
        for i in range(7)
    ]
    light = View(
        "l", tpot_ms=200.0, ttft_deadline=13.0, arrival_time=10.0, num_prompt_tokens=100, tenant="light"
    )
    more_heavy = replace(light, request_id="hw", tenant="heavy")
    limits = StepLimits(4096, 8, now=10.5)
    limit = SloBudget(params).budget(heavy, [light, more_heavy], limits).time_limit
    assert limit is not None and limit.max_ms == pytest.approx(80.0)
    # light's whole prompt beside heavy's 7 decodes (10 + 7 + 400); heavy's own next prompt stays
    # within its streams' time in hand: one 16-token chunk (10 + 7 + 64) beside them.
    assert limit.first_token_ms == {"l": pytest.approx(417.0), "hw": pytest.approx(81.0)}
    # One tenant (or none named): every stream counts for every prompt.
    anonymous = [replace(r, tenant=None) for r in heavy]
    limit = SloBudget(params).budget(anonymous, [replace(light, tenant=None)], limits).time_limit
    assert limit is not None and limit.first_token_ms == {"l": pytest.approx(81.0)}
    # Light as far in slots as heavy (4 each, its waiting one counted) is bounded like anyone.
    light_streams = [replace(r, request_id=f"ls{i}", tenant="light") for i, r in enumerate(heavy[:3])]
    limit = SloBudget(params).budget([*heavy[:4], *light_streams], [light], limits).time_limit
    assert limit is not None and limit.first_token_ms == {"l": pytest.approx(81.0)}


def test_batch_steps_come_in_pieces_once_an_urgent_tier_was_seen() -> None:
    params = SloBudgetParams(fixed_ms=10.0, per_decode_ms=1.0)
    batch = [View("b", tier_rank=2, num_prompt_tokens=2000)]
    limits = StepLimits(4096, 64, now=0.0)
    policy = SloBudget(params)
    limit = policy.budget(batch, [], limits).time_limit  # no urgent request seen yet: 1 s assumed
    assert limit is not None and limit.max_ms == pytest.approx(200.0)
    policy.budget([View("i", tier_rank=0, tpot_ms=100.0, ttft_deadline=0.5)], batch, limits)
    limit = policy.budget(batch, [], limits).time_limit
    assert limit is not None and limit.max_ms == pytest.approx(100.0)  # 0.2 · the 0.5 s TTFT seen
    off = SloBudget(SloBudgetParams(idle_ttft_fraction=0.0))
    off.budget([View("i", tier_rank=0, tpot_ms=100.0, ttft_deadline=1.0)], batch, limits)
    assert off.budget(batch, [], limits).time_limit is None


def test_slo_budget_learns_the_cost_in_the_harness() -> None:
    cost = CostModel(
        fixed_ms=4.0, per_token_ms=0.3, per_decode_ms=0.6, per_context_token_ms=0.002, noise=0.03, seed=1
    )
    policy = SloBudget(SloBudgetParams())  # priors 10 / 0.5 / 0.5 / 0.0005: wrong on purpose
    requests = poisson_workload(seed=2, rate_per_s=10, duration_s=8, mix=[(INTERACTIVE, 1.0)])
    result = simulate(requests, budget=policy, config=SimConfig(cost=cost))
    assert 200 < len(result.steps) < 1500
    learnt = policy.model.cost
    assert learnt.per_decode_ms == pytest.approx(0.6, rel=0.2)
    assert learnt.per_prefill_token_ms == pytest.approx(0.3, rel=0.2)


def test_a_step_under_the_time_limit_carries_the_urgent_decodes_and_what_fits_beside_them() -> None:
    # 8 interactive streams and 40 batch streams, all decoding; each decode costs 2 ms, fixed 10 ms:
    # 80 ms (0.8 · 100) holds 35 decodes: the 8 interactive ones and 27 batch ones.
    cost = CostModel(fixed_ms=10.0, per_token_ms=0.5, per_decode_ms=2.0, per_context_token_ms=0.0)
    requests = [SimRequest(f"i{i}", 0.0, INTERACTIVE, 16, 200) for i in range(8)]
    requests += [SimRequest(f"b{i}", 0.0, BATCH, 16, 200) for i in range(40)]
    policy = SloBudget(SloBudgetParams(fixed_ms=10.0, per_decode_ms=2.0, per_prefill_token_ms=0.5))
    result = simulate(requests, ordering=Tiered(TieredParams()), budget=policy, config=SimConfig(cost=cost))
    while_interactive = [s for s in result.steps if any(f"i{i}" in s.num_scheduled_tokens for i in range(8))]
    decoding = [s for s in while_interactive if set(s.num_scheduled_tokens.values()) == {1}]
    assert len(decoding) > 100
    for step in while_interactive[1:]:
        assert all(f"i{i}" in step.num_scheduled_tokens for i in range(8))  # urgent first, always
        assert step.elapsed_ms <= 80.0 + 1e-6
    for step in decoding:
        # filled with batch decodes, not shrunk (35 fit exactly; the fitted model is a little off)
        assert len(step.num_scheduled_tokens) >= 30
    assert result.tiers["interactive"].tpot_p99_ms is not None
    assert result.tiers["interactive"].tpot_p99_ms <= 100.0
    assert result.tiers["batch"].num_finished == 40  # batch decodes sat out steps, none was lost


def test_an_infeasible_target_gets_the_shortest_steps_without_starving_the_rest() -> None:
    # One decode step costs 61 ms: 0.8 · 100 < 2 · 61, so the 100 ms TPOT cannot hold beside much else.
    cost = CostModel(fixed_ms=60.0, per_token_ms=0.5, per_decode_ms=1.0, per_context_token_ms=0.0)
    requests = [SimRequest("i", 0.0, INTERACTIVE, 16, 100)]
    requests += [SimRequest(f"b{i}", 0.0, BATCH, 16, 100) for i in range(30)]
    budgets = {
        "static": Static(NoParams()),
        "slo": SloBudget(SloBudgetParams(fixed_ms=60.0, per_decode_ms=1.0)),
    }
    results = {
        name: simulate(requests, ordering=Tiered(TieredParams()), budget=b, config=SimConfig(cost=cost))
        for name, b in budgets.items()
    }
    # 2 · 61 = 122 ms steps hold all 31 decodes (60 + 31 = 91 ms): nothing is held back for nothing.
    assert results["slo"].throughput_tok_s >= 0.95 * results["static"].throughput_tok_s
    assert all(r.finished for r in results["slo"].requests.values())


def test_under_overload_tiered_with_slo_budget_keeps_interactive_tpot_and_fcfs_static_does_not() -> None:
    # 30% interactive (TTFT 1 s, TPOT 100 ms), 70% batch, at about twice what the engine sustains.
    requests = poisson_workload(seed=7, rate_per_s=8, duration_s=60, mix=[(INTERACTIVE, 0.3), (BATCH, 0.7)])
    config = SimConfig(kv_capacity_tokens=40_000)
    fcfs = simulate(
        requests,
        ordering=Fcfs(NoParams()),
        budget=Static(NoParams()),
        preemption=Newest(NoParams()),
        config=config,
    )
    tiered = simulate(
        requests,
        ordering=Tiered(TieredParams()),
        budget=SloBudget(SloBudgetParams()),
        preemption=LowestTier(NoParams()),
        config=config,
    )
    assert INTERACTIVE.tpot_ms is not None
    for result in (fcfs, tiered):  # the batch tier still finishes either way
        assert result.tiers["batch"].num_finished == result.tiers["batch"].num_requests
    fcfs_interactive, tiered_interactive = fcfs.tiers["interactive"], tiered.tiers["interactive"]
    assert tiered_interactive.tpot_p99_ms is not None and fcfs_interactive.tpot_p99_ms is not None
    assert tiered_interactive.tpot_p99_ms <= INTERACTIVE.tpot_ms < fcfs_interactive.tpot_p99_ms
    assert tiered_interactive.slo_attainment >= 0.9 > 0.5 > fcfs_interactive.slo_attainment
    assert tiered.throughput_tok_s >= 0.8 * fcfs.throughput_tok_s


def test_an_urgent_arrival_does_not_wait_behind_a_full_size_batch_prefill() -> None:
    # About this repo's CPU VM on the Q4_1 model: a prefill token or a decode ~1.9 ms, fixed 8.5 ms.
    # Twenty 500-token batch prompts at t=0 (a 2,048-token step would take ~3.8 s), then one
    # interactive request (TTFT 1 s) at t=0.5 with a 200-token prompt.
    cost = CostModel(fixed_ms=8.5, per_token_ms=1.87, per_decode_ms=1.8, per_context_token_ms=0.0)
    requests = [SimRequest(f"b{i}", 0.0, BATCH, 500, 32) for i in range(20)]
    requests.append(SimRequest("i", 0.5, INTERACTIVE, 200, 20))
    priors = {
        "fixed_ms": 8.5,
        "per_decode_ms": 1.8,
        "per_prefill_token_ms": 1.87,
        "per_context_token_ms": 0.0,
    }

    def run(idle_ttft_fraction: float) -> SimResult:
        budget = SloBudget(SloBudgetParams(idle_ttft_fraction=idle_ttft_fraction, **priors))
        return simulate(requests, ordering=Tiered(TieredParams()), budget=budget, config=SimConfig(cost=cost))

    capped, uncapped = run(0.2), run(0.0)
    ttft = {
        name: r.requests["i"].token_times[0] - 0.5 for name, r in (("capped", capped), ("uncapped", uncapped))
    }
    assert ttft["uncapped"] > 1.0  # it waited for the 2,048-token step
    assert ttft["capped"] < 0.7  # at most a 200 ms step, then its whole prompt in one step
    prefill_steps = [s for s in capped.steps if s.num_scheduled_tokens.get("i", 0) > 1]
    assert len(prefill_steps) == 1 and prefill_steps[0].num_scheduled_tokens["i"] == 200
    # batch prefill in pieces: even the step's first request has its chunk cut to the limit
    others = [s for s in capped.steps if s is not prefill_steps[0]]
    assert max(s.elapsed_ms for s in others) <= 200.0 + 1e-6
    assert all(r.finished for r in capped.requests.values())
    assert capped.throughput_tok_s >= 0.9 * uncapped.throughput_tok_s  # pieces, not a slowdown
