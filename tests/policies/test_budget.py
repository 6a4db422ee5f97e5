"""budget.static and budget.slo-budget: within the limits, and slo-budget keeps the strictest TPOT."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.base import NoParams, StepLimits, StepReport
from policies.budget import SloBudget, SloBudgetParams, Static, StepTimeModel
from policies.ordering import Fcfs, Tiered
from policies.preemption import LowestTier, Newest
from tests.policies.views import View, views
from tierserve.testing import CostModel, SimConfig, poisson_workload, simulate
from wire.tier import DEFAULT_TIERS

INTERACTIVE, _, BATCH = DEFAULT_TIERS
limits_st = st.builds(StepLimits, st.integers(1, 8192), st.integers(1, 256))
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


@given(
    views(),
    views(),
    st.integers(1, 8192),
    st.integers(1, 256),
    st.integers(1, 64),
    st.floats(0.05, 1.0),
    reports_st,
)
def test_slo_budget_stays_within_the_limits_and_min_tokens(
    running: list[View],
    waiting: list[View],
    max_tokens: int,
    max_seqs: int,
    min_tokens: int,
    safety: float,
    reports: list[StepReport],
) -> None:
    max_tokens = max(max_tokens, min_tokens)  # see the xfail below for min_tokens above the limit
    policy = SloBudget(SloBudgetParams(safety=safety, min_tokens=min_tokens))
    for report in reports:  # whatever it has learnt
        policy.observe(report)
    budget = policy.budget(running, waiting, StepLimits(max_tokens, max_seqs))
    assert min_tokens <= budget.max_num_tokens <= max_tokens
    assert 1 <= budget.max_num_seqs <= max_seqs


def test_slo_budget_never_exceeds_a_limit_below_min_tokens() -> None:
    policy = SloBudget(SloBudgetParams(min_tokens=8))
    running = [View("r", tpot_ms=1.0, num_prompt_tokens=10_000)]
    assert policy.budget(running, [], StepLimits(4, 4)).max_num_tokens <= 4


@given(views(), views(), limits_st)
def test_slo_budget_is_the_ceiling_without_a_tpot_target(
    running: list[View], waiting: list[View], limits: StepLimits
) -> None:
    untargeted = [View(r.request_id, num_prompt_tokens=r.num_prompt_tokens) for r in (*running, *waiting)]
    budget = SloBudget(SloBudgetParams()).budget(
        untargeted[: len(running)], untargeted[len(running) :], limits
    )
    assert (budget.max_num_tokens, budget.max_num_seqs) == (
        limits.max_num_batched_tokens,
        limits.max_num_seqs,
    )


def test_slo_budget_follows_its_model_and_shrinks_as_context_grows() -> None:
    params = SloBudgetParams(
        safety=0.8, min_tokens=4, fixed_ms=10.0, per_token_ms=0.5, per_context_token_ms=0.001
    )
    policy = SloBudget(params)
    limits = StepLimits(4096, 64)
    budgets = []
    for context in (0, 10_000, 30_000, 60_000, 100_000):
        running = [View(f"r{i}", tpot_ms=100.0, num_prompt_tokens=context // 10 or 1) for i in range(10)]
        budgets.append(policy.budget(running, [], limits).max_num_tokens)
    # 0.8 · 100 ms = 10 + 0.5·n + 0.001·C  →  n = (70 − 0.001·C) / 0.5
    assert budgets[0] == 139  # C = 10 (ten one-token prompts): (70 - 0.01) / 0.5 = 139.98
    assert budgets[1] == int((70 - 10.0) / 0.5)
    assert budgets == sorted(budgets, reverse=True) and budgets[-1] == params.min_tokens
    # The strictest target counts, waiting requests included.
    stricter = [View("w", tpot_ms=50.0)]
    assert policy.budget([View("r", tpot_ms=100.0)], stricter, limits).max_num_tokens == int(
        (40 - 10 - 0.016) / 0.5
    )


TRUE_COST = CostModel(fixed_ms=4.0, per_token_ms=0.3, per_context_token_ms=0.002)


def fit(model: StepTimeModel, num_reports: int, *, seed: int, steady: bool = False) -> None:
    """Feed ``model`` reports of TRUE_COST with 3% noise: varied steps, or a steady decode load."""
    rng = random.Random(seed)
    for _ in range(num_reports):
        if steady:
            tokens, context = 64, 32_000 + rng.randint(-64, 64)
        else:
            tokens, context = rng.randint(1, 1024), rng.randint(0, 50_000)
        model.update(tokens, context, TRUE_COST.mean_step_ms(tokens, context) * (1 + rng.gauss(0, 0.03)))


def assert_close_to_true_cost(model: StepTimeModel) -> None:
    a, b, c = model.theta
    assert a == pytest.approx(4.0, abs=2.0)
    assert b == pytest.approx(0.3, rel=0.05)
    assert c == pytest.approx(0.002, rel=0.05)
    for tokens, context in ((1, 1000), (64, 20_000), (1024, 50_000)):
        # 10%, or 1.5 ms for the tiniest step: with 3% noise and a ~50-step memory the intercept
        # wanders by about a millisecond.
        assert model.predict(tokens, context) == pytest.approx(
            TRUE_COST.mean_step_ms(tokens, context), rel=0.1, abs=1.5
        )


def test_step_time_model_converges_to_a_linear_cost_from_noisy_reports() -> None:
    model = StepTimeModel(prior=(10.0, 0.5, 0.0005), forget=0.98)
    fit(model, 500, seed=3)
    assert_close_to_true_cost(model)


def test_step_time_model_stays_converged_over_thousands_of_reports() -> None:
    model = StepTimeModel(prior=(10.0, 0.5, 0.0005), forget=0.98)
    fit(model, 3000, seed=3)
    assert_close_to_true_cost(model)


def test_step_time_model_stays_accurate_under_a_steady_decode_load() -> None:
    model = StepTimeModel(prior=(10.0, 0.5, 0.0005), forget=0.98)
    fit(model, 2000, seed=3, steady=True)
    assert model.predict(64, 32_000) == pytest.approx(TRUE_COST.mean_step_ms(64, 32_000), rel=0.1)


def test_slo_budget_learns_the_cost_in_the_harness() -> None:
    cost = CostModel(fixed_ms=4.0, per_token_ms=0.3, per_context_token_ms=0.002, noise=0.03, seed=1)
    policy = SloBudget(SloBudgetParams())  # priors 10 / 0.5 / 0.0005: wrong on purpose
    requests = poisson_workload(seed=2, rate_per_s=10, duration_s=8, mix=[(INTERACTIVE, 1.0)])
    result = simulate(requests, budget=policy, config=SimConfig(cost=cost))
    assert 200 < len(result.steps) < 1500
    _a, b, c = policy.model.theta
    assert b == pytest.approx(0.3, rel=0.15) and c == pytest.approx(0.002, rel=0.25)


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
        ordering=Tiered(NoParams()),
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
