"""tierserve.testing itself: the harness runs the worker's scheduler, by hand-computed cases."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest

from policies.base import NoParams, SeqView, StepBudget, StepLimits, StepReport
from policies.budget import Static
from policies.ordering import Fcfs
from tierserve.testing import (
    CostModel,
    PolicyContractError,
    SimConfig,
    SimRequest,
    SimSeq,
    poisson_workload,
    simulate,
)
from wire.tier import DEFAULT_TIERS, Tier

INTERACTIVE, STANDARD, BATCH = DEFAULT_TIERS
# 10 ms a step, 1 ms a new token, 0.1 ms per context token: easy sums.
SIMPLE = CostModel(fixed_ms=10.0, per_token_ms=1.0, per_context_token_ms=0.1)


def test_one_request_by_hand() -> None:
    result = simulate([SimRequest("r", 0.0, INTERACTIVE, 10, 3)], config=SimConfig(cost=SIMPLE))
    r = result.requests["r"]
    # prefill 10 tokens, context 10: 10 + 10 + 1 = 21 ms; then decodes of 1 token over 11, 12 tokens.
    assert r.token_times == pytest.approx((0.021, 0.021 + 0.0121, 0.021 + 0.0121 + 0.0122))
    assert r.ttft_ms == pytest.approx(21.0)
    assert r.tpot_ms == pytest.approx(12.15)
    assert r.finished and r.finish_time == pytest.approx(0.0453) and r.meets_slo
    assert [s.num_scheduled_tokens for s in result.steps] == [{"r": 10}, {"r": 1}, {"r": 1}]
    assert result.end_time == pytest.approx(0.0453)


def test_a_long_prompt_is_prefilled_in_chunks_beside_decodes() -> None:
    requests = [SimRequest("short", 0.0, STANDARD, 4, 5), SimRequest("long", 0.0, STANDARD, 20, 1)]
    result = simulate(requests, config=SimConfig(max_num_batched_tokens=8, cost=SIMPLE))
    steps = [s.num_scheduled_tokens for s in result.steps]
    # Step 1 admits both in arrival order: short's whole prompt, then what is left of 8 for long.
    # From then on short decodes 1 token a step first (it is running), long gets the rest.
    assert steps[:4] == [
        {"short": 4, "long": 4},
        {"short": 1, "long": 7},
        {"short": 1, "long": 7},
        {"short": 1, "long": 2},
    ]
    assert result.requests["long"].token_times[0] == result.steps[3].start + result.steps[3].elapsed_ms / 1e3
    assert all(sum(s.values()) <= 8 for s in steps)


def test_arrivals_wait_for_the_clock_and_an_idle_engine_jumps_to_the_next_one() -> None:
    requests = [SimRequest("a", 0.0, BATCH, 10, 1), SimRequest("b", 5.0, BATCH, 10, 1)]
    result = simulate(requests, config=SimConfig(cost=SIMPLE))
    assert [s.start for s in result.steps] == [0.0, 5.0]
    assert result.requests["b"].ttft_ms == pytest.approx(21.0)


def test_max_num_seqs_and_the_budget_bound_each_step() -> None:
    class Three:
        kind: ClassVar[str] = "budget"

        def budget(
            self, running: Sequence[SeqView], waiting: Sequence[SeqView], limits: StepLimits
        ) -> StepBudget:
            return StepBudget(max_num_tokens=3, max_num_seqs=2)

        def observe(self, report: StepReport) -> None:
            self.last = report

    policy = Three()
    requests = [SimRequest(f"r{i}", 0.0, STANDARD, 1, 4) for i in range(5)]
    result = simulate(requests, budget=policy, config=SimConfig(max_num_seqs=4, cost=SIMPLE))
    assert all(
        len(s.num_scheduled_tokens) <= 2 and sum(s.num_scheduled_tokens.values()) <= 3 for s in result.steps
    )
    assert all(r.finished for r in result.requests.values())
    last = result.steps[-1]
    assert policy.last == StepReport(
        sum(last.num_scheduled_tokens.values()),
        len(last.num_scheduled_tokens),
        last.num_context_tokens,
        last.elapsed_ms,
        sum(n == 1 for n in last.num_scheduled_tokens.values()),
    )


def test_preemption_recomputes_the_victim_and_admits_nobody_in_that_step() -> None:
    requests = [SimRequest("old", 0.0, STANDARD, 20, 15), SimRequest("new", 0.001, STANDARD, 20, 15)]
    result = simulate(requests, config=SimConfig(kv_capacity_tokens=60, cost=SIMPLE))
    new = result.requests["new"]
    assert new.finished and new.num_preemptions >= 1 and result.requests["old"].num_preemptions == 0
    preempting = next(i for i, s in enumerate(result.steps) if s.preempted)
    assert result.steps[preempting].preempted == ("new",)
    assert "new" not in result.steps[preempting].num_scheduled_tokens
    # Resumed: prompt and the tokens it had emitted are computed again in one chunk.
    resumed = next(s for s in result.steps[preempting + 1 :] if "new" in s.num_scheduled_tokens)
    assert resumed.num_scheduled_tokens["new"] > 1


def test_a_request_bigger_than_the_cache_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="more KV than the whole cache"):
        simulate([SimRequest("r", 0.0, STANDARD, 50, 20)], config=SimConfig(kv_capacity_tokens=60))


def test_unfinished_requests_at_max_time_miss_their_slo() -> None:
    result = simulate([SimRequest("r", 0.0, STANDARD, 10, 1000)], config=SimConfig(max_time_s=1.0))
    r = result.requests["r"]
    assert not r.finished and r.finish_time is None and not r.meets_slo
    assert result.tiers["standard"].slo_attainment == 0.0 and result.tiers["standard"].num_finished == 0


def test_slo_attainment_per_tier() -> None:
    slow = Tier(name="slow-ok", rank=1, tpot_ms=1000.0)
    tight = Tier(name="tight", rank=0, ttft_ms=1.0)  # no step is that fast
    result = simulate([SimRequest("a", 0.0, slow, 10, 4), SimRequest("b", 0.0, tight, 10, 4)])
    assert list(result.tiers) == ["tight", "slow-ok"]  # most urgent first
    assert result.tiers["slow-ok"].slo_attainment == 1.0
    assert result.tiers["tight"].slo_attainment == 0.0
    assert result.tiers["tight"].num_output_tokens == 4


def test_runs_are_deterministic_noise_included() -> None:
    requests = poisson_workload(
        seed=5, rate_per_s=20, duration_s=3, mix=[(INTERACTIVE, 1), (BATCH, 2)], tenants=["x", "y"]
    )
    assert requests == poisson_workload(
        seed=5, rate_per_s=20, duration_s=3, mix=[(INTERACTIVE, 1), (BATCH, 2)], tenants=["x", "y"]
    )
    assert {r.tenant for r in requests} == {"x", "y"} and {r.tier.name for r in requests} == {
        "interactive",
        "batch",
    }
    config = SimConfig(cost=CostModel(noise=0.2, seed=9))
    first, second = simulate(requests, config=config), simulate(requests, config=config)
    assert first.requests == second.requests and first.end_time == second.end_time


class Dropper:
    kind: ClassVar[str] = "ordering"

    def order(self, requests: Sequence[SeqView], now: float) -> list[SeqView]:
        return list(requests[1:])


class Overspender:
    kind: ClassVar[str] = "budget"

    def budget(
        self, running: Sequence[SeqView], waiting: Sequence[SeqView], limits: StepLimits
    ) -> StepBudget:
        return StepBudget(limits.max_num_batched_tokens + 1, limits.max_num_seqs)

    def observe(self, report: StepReport) -> None:
        pass


class Outsider:
    kind: ClassVar[str] = "preemption"

    def victim(self, candidates: Sequence[SeqView]) -> SeqView:
        return _OUTSIDE


_OUTSIDE = SimSeq(SimRequest("ghost", 0.0, STANDARD, 1, 1))


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        ({"ordering": Dropper()}, r"Dropper\.order did not return a permutation of its 2 requests"),
        ({"budget": Overspender()}, r"Overspender\.budget returned .*2049.* outside 1\.\."),
        ({"preemption": Outsider()}, r"Outsider\.victim returned SimSeq\('ghost'.*not one of its"),
    ],
)
def test_a_policy_that_breaks_its_contract_is_named(policies: dict[str, object], message: str) -> None:
    requests = [SimRequest("a", 0.0, STANDARD, 20, 15), SimRequest("b", 0.0, STANDARD, 20, 15)]
    with pytest.raises(PolicyContractError, match=message):
        simulate(requests, config=SimConfig(kv_capacity_tokens=40), **policies)  # type: ignore[arg-type]


def test_baselines_stand_in_for_policies_not_given() -> None:
    requests = poisson_workload(seed=1, rate_per_s=5, duration_s=2, mix=[(STANDARD, 1)])
    assert (
        simulate(requests).requests
        == simulate(requests, ordering=Fcfs(NoParams()), budget=Static(NoParams())).requests
    )
