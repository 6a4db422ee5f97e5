"""policies.tenant_service: what a tenant is charged, the lift, and what is forgotten."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.tenant_service import TenantService
from tests.policies.views import View


def service(forget_after_s: float = 300.0) -> TenantService:
    return TenantService(input_weight=1.0, output_weight=2.0, forget_after_s=forget_after_s)


def test_growth_is_charged_inputs_once_outputs_at_their_weight() -> None:
    s = service()
    r = View("r", tenant="t", num_prompt_tokens=100)
    s.observe([r], now=0.0)
    assert s.counter("t") == 0.0  # first sight: nothing computed yet to charge
    r = replace(r, num_computed_tokens=100, num_output_tokens=1)  # the prefill and its first token
    s.observe([r], now=1.0)
    assert s.counter("t") == pytest.approx(99 * 1.0 + 1 * 2.0)
    r = replace(r, num_computed_tokens=101, num_output_tokens=2)  # a decode
    s.observe([r], now=2.0)
    assert s.counter("t") == pytest.approx(101.0 + 2.0)


def test_a_preemption_is_not_a_negative_charge_and_recomputation_counts() -> None:
    s = service()
    r = View("r", tenant="t", num_prompt_tokens=100)
    s.observe([r], now=0.0)
    for computed in (60, 0, 30):  # computed, preempted (KV given back), recomputing
        r = replace(r, num_computed_tokens=computed)
        s.observe([r], now=1.0)
    assert s.counter("t") == 90.0


def test_the_tentative_cost_is_what_is_left_to_compute_and_one_token_out() -> None:
    s = service()
    assert s.step_cost(View("w", num_prompt_tokens=50)) == 49 + 2.0
    assert s.step_cost(View("d", num_prompt_tokens=50, num_output_tokens=3, num_computed_tokens=52)) == 2.0


def test_a_new_or_returning_tenant_starts_at_the_least_active_counter() -> None:
    s = service(forget_after_s=10.0)
    a, b = View("a", tenant="a"), View("b", tenant="b")
    s.observe([a, b], now=0.0)
    a, b = replace(a, num_computed_tokens=50), replace(b, num_computed_tokens=80)
    s.observe([a, b], now=1.0)
    assert (s.counter("a"), s.counter("b")) == (50.0, 80.0)
    s.observe([b], now=2.0)  # a's request finished
    s.observe([b, View("c", tenant="c")], now=3.0)
    assert s.counter("c") == 80.0  # a newcomer gets no credit for the past
    s.observe([b, View("a2", tenant="a")], now=4.0)
    assert s.counter("a") == 80.0  # idling banked nothing: lifted from 50


def test_a_returning_tenant_keeps_a_counter_above_the_floor() -> None:
    s = service()
    heavy, light = View("h", tenant="heavy"), View("l", tenant="light")
    s.observe([heavy, light], now=0.0)
    s.observe([replace(heavy, num_computed_tokens=16), replace(light, num_computed_tokens=4)], now=1.0)
    s.observe([light], now=2.0)  # heavy's backlog emptied for a step
    s.observe([light, View("h2", tenant="heavy")], now=3.0)
    assert s.counter("heavy") == 16.0  # its debt is not wiped by a short gap


def test_finished_requests_and_idle_tenants_are_forgotten() -> None:
    s = service(forget_after_s=10.0)
    s.observe([View(f"r{i}", tenant=f"t{i}") for i in range(100)], now=0.0)
    assert (s.num_requests, s.num_tenants) == (100, 100)
    s.observe([View("r0", tenant="t0")], now=5.0)
    assert (s.num_requests, s.num_tenants) == (1, 100)  # finished requests go at once
    s.observe([View("r0", tenant="t0")], now=11.0)
    assert (s.num_requests, s.num_tenants) == (1, 1)  # idle tenants after forget_after_s
    s.observe([], now=30.0)
    assert (s.num_requests, s.num_tenants) == (0, 0)


def test_requests_without_a_tenant_share_one_counter() -> None:
    s = service()
    one, two = View("1"), View("2")
    s.observe([one, two], now=0.0)
    s.observe([replace(one, num_computed_tokens=5), replace(two, num_computed_tokens=7)], now=1.0)
    assert s.counter(None) == 12.0
