"""ordering.tenant-fair: direct cases on hand-made views, then the harness under a tenant imbalance."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pytest
from tierserve_tenant_fair import TenantFair, TenantFairParams

from tierserve.testing import SimConfig, SimRequest, simulate
from wire.tier import DEFAULT_TIERS

INTERACTIVE, STANDARD, BATCH = DEFAULT_TIERS


@dataclass
class View:
    """A request as the ordering sees it; mutable here so a test can play the engine's progress."""

    request_id: str
    tenant: str | None
    priority: int = 0
    arrival_time: float = 0.0
    tier_rank: int = 1
    tier_name: str = "standard"
    num_prompt_tokens: int = 100
    num_output_tokens: int = 0
    num_computed_tokens: int = 0
    tpot_ms: float | None = None
    ttft_deadline: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


def ids(requests: list) -> list[str]:
    return [r.request_id for r in requests]


def fair(**params: object) -> TenantFair:
    return TenantFair(TenantFairParams(**params))  # type: ignore[arg-type]


def test_the_tenant_with_less_service_goes_first() -> None:
    policy = fair()
    heavy = View("h1", "heavy", arrival_time=0.0)
    light = View("l1", "light", arrival_time=5.0)
    policy.order([heavy, light], now=0.0)
    heavy.num_computed_tokens = 100  # its prompt was computed and its first token came out
    heavy.num_output_tokens = 1
    light.num_computed_tokens = 40  # a prefill chunk
    assert ids(policy.order([heavy, light], now=1.0)) == ["l1", "h1"]
    assert policy.service == {"heavy": pytest.approx(99 * 1.0 + 1 * 2.0), "light": pytest.approx(40.0)}
    light.num_computed_tokens = 100
    light.num_output_tokens = 1
    light.num_computed_tokens += 1
    light.num_output_tokens += 1  # light is now ahead in service (99 + 2·2 = 103 > 101)
    assert ids(policy.order([heavy, light], now=2.0)) == ["h1", "l1"]


def test_a_tenant_arriving_late_gets_no_credit_for_the_past() -> None:
    policy = fair()
    early = View("e1", "early")
    policy.order([early], now=0.0)
    early.num_computed_tokens = 100
    late = View("l1", "late", arrival_time=5.0)
    policy.order([early, late], now=1.0)
    assert policy.service["late"] == policy.service["early"] == 100.0


def test_requests_of_one_tenant_interleave_with_another_by_tentative_charge() -> None:
    policy = fair()
    a = [View(f"a{i}", "a", arrival_time=i, num_prompt_tokens=1, num_output_tokens=0) for i in range(3)]
    b = View("b0", "b", arrival_time=10.0, num_prompt_tokens=1)
    # Equal service (0): a wins the tie by name, is charged one token out, then b, then a's rest.
    assert ids(policy.order([*a, b], now=0.0)) == ["a0", "b0", "a1", "a2"]


def test_tiers_come_first_unless_told_otherwise() -> None:
    heavy_interactive = View("hi", "heavy", tier_rank=0, arrival_time=1.0)
    light_batch = View("lb", "light", tier_rank=2, arrival_time=0.0)
    for policy, expected in ((fair(), ["hi", "lb"]), (fair(respect_tiers=False), ["lb", "hi"])):
        policy.service["heavy"] = 1e6
        policy.service["light"] = 0.0
        assert ids(policy.order([light_batch, heavy_interactive], now=0.0)) == expected


def test_a_returning_tenant_starts_at_the_least_active_counter() -> None:
    policy = fair(forget_after_s=10.0)
    a = View("a", "a")
    b = View("b", "b")
    policy.order([a, b], now=0.0)
    a.num_computed_tokens = 50
    b.num_computed_tokens = 80
    policy.order([a, b], now=1.0)
    assert (policy.service["a"], policy.service["b"]) == (50.0, 80.0)
    # a finishes; long after its request is forgotten it comes back and is lifted to b's level.
    policy.order([b], now=20.0)
    assert policy.num_tracked_requests == 1
    policy.order([b, View("a2", "a")], now=21.0)
    assert policy.service["a"] == 80.0


def test_a_preemption_is_not_a_negative_charge() -> None:
    policy = fair()
    r = View("r", "t")
    policy.order([r], now=0.0)
    r.num_computed_tokens = 60
    policy.order([r], now=1.0)
    r.num_computed_tokens = 0  # preempted: its KV was given back
    policy.order([r], now=2.0)
    r.num_computed_tokens = 30  # recomputing is service too
    policy.order([r], now=3.0)
    assert policy.service["t"] == 90.0


def test_weights_must_count_something() -> None:
    with pytest.raises(ValueError, match="both be 0"):
        fair(input_weight=0.0, output_weight=0.0)


def test_in_the_harness_a_light_tenant_is_not_starved_by_a_heavy_one() -> None:
    # One tier; "heavy" sends ten times the requests of "light", together well past capacity.
    requests = [
        SimRequest(f"h{i}", i * 0.05, STANDARD, num_prompt_tokens=256, num_output_tokens=32, tenant="heavy")
        for i in range(400)
    ] + [
        SimRequest(
            f"l{i}", 0.3 + i * 0.5, STANDARD, num_prompt_tokens=256, num_output_tokens=32, tenant="light"
        )
        for i in range(40)
    ]
    config = SimConfig(max_num_batched_tokens=512, max_num_seqs=16)

    def light_ttft_ms(**kwargs: object) -> float:
        result = simulate(requests, config=config, **kwargs)  # type: ignore[arg-type]
        assert all(r.finished for r in result.requests.values())
        return statistics.median(
            r.ttft_ms for r in result.requests.values() if r.tenant == "light" and r.ttft_ms is not None
        )

    fcfs_ms = light_ttft_ms()
    fair_ms = light_ttft_ms(ordering=fair())
    assert fair_ms * 10 < fcfs_ms, (fair_ms, fcfs_ms)
