"""Degradation built-ins and the TTFT predictor: "fallback" only for a degradable tier with a ready
fallback; never is always the primary; degrade-on-slo degrades on an open circuit, or on a predicted
TTFT past safety × target when the fallback is faster, and a later prediction never undoes that."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.base import NoParams
from policies.degradation import (
    DegradationPolicy,
    DegradationView,
    DegradeOnSlo,
    DegradeOnSloParams,
    Never,
    predict_ttft_s,
    worker_queue_s,
)
from policies.registry import PolicyError, load_policy
from policies.routing import WorkerView
from wire.tier import Tier

INTERACTIVE = Tier(name="interactive", rank=0, ttft_ms=1000.0, tpot_ms=100.0, degradable=True)
STANDARD = Tier(name="standard", rank=1, ttft_ms=3000.0, tpot_ms=200.0)  # not degradable
BATCH = Tier(name="batch", rank=2, sheddable=True, degradable=True)  # no TTFT target


def view(
    tier: Tier = INTERACTIVE,
    *,
    predicted: float | None = 0.1,
    circuit_open: bool = False,
    fallback: str | None = "small",
    fallback_ready: bool = True,
    fallback_predicted: float | None = 0.05,
) -> DegradationView:
    return DegradationView(
        tier=tier,
        primary="big",
        fallback=fallback,
        seats=1,
        predicted_ttft_s=predicted,
        primary_circuit_open=circuit_open,
        fallback_ready=fallback_ready and fallback is not None,
        fallback_predicted_ttft_s=fallback_predicted,
    )


tiers = st.sampled_from([INTERACTIVE, STANDARD, BATCH])
seconds = st.none() | st.floats(0.0, 100.0)
views = st.builds(
    view,
    tiers,
    predicted=seconds,
    circuit_open=st.booleans(),
    fallback=st.sampled_from([None, "small"]),
    fallback_ready=st.booleans(),
    fallback_predicted=seconds,
)
params = st.builds(
    DegradeOnSloParams,
    safety=st.floats(0.05, 2.0),
    unknown_is_late=st.booleans(),
    require_faster_fallback=st.booleans(),
)


def policies() -> list[DegradationPolicy]:
    return [Never(NoParams()), DegradeOnSlo(DegradeOnSloParams())]


@given(views, params)
def test_fallback_only_for_a_degradable_tier_with_a_ready_fallback(
    v: DegradationView, p: DegradeOnSloParams
) -> None:
    for policy in [*policies(), DegradeOnSlo(p)]:
        choice = policy.decide(v)
        assert choice in ("primary", "fallback")
        if choice == "fallback":
            assert v.tier.degradable and v.fallback_ready


@given(views)
def test_never_is_always_the_primary(v: DegradationView) -> None:
    assert Never(NoParams()).decide(v) == "primary"


@given(views, params)
def test_an_open_circuit_degrades_whenever_it_may(v: DegradationView, p: DegradeOnSloParams) -> None:
    circuit = DegradationView(**{**_fields(v), "primary_circuit_open": True})
    expected = "fallback" if circuit.tier.degradable and circuit.fallback_ready else "primary"
    assert DegradeOnSlo(p).decide(circuit) == expected


@given(views, params, st.floats(0.0, 100.0))
def test_a_later_prediction_never_undoes_a_degradation(
    v: DegradationView, p: DegradeOnSloParams, extra: float
) -> None:
    """Monotone in the primary's predicted TTFT: if it degrades at t it degrades at any t' > t."""
    policy = DegradeOnSlo(p)
    if v.predicted_ttft_s is None or policy.decide(v) != "fallback":
        return
    later = DegradationView(**{**_fields(v), "predicted_ttft_s": v.predicted_ttft_s + extra})
    assert policy.decide(later) == "fallback"


def _fields(v: DegradationView) -> dict[str, object]:
    return {name: getattr(v, name) for name in DegradationView.__slots__}


def test_degrade_on_slo_examples() -> None:
    policy = DegradeOnSlo(DegradeOnSloParams())  # safety 0.8: late past 0.8 s for interactive
    assert policy.decide(view(predicted=0.5)) == "primary"
    assert policy.decide(view(predicted=0.81)) == "fallback"
    assert policy.decide(view(predicted=0.81, fallback_predicted=0.9)) == "primary"  # fallback slower
    assert policy.decide(view(predicted=0.81, fallback_predicted=None)) == "primary"  # fallback unknown
    assert policy.decide(view(predicted=None)) == "fallback"  # must queue, nothing drained: late
    assert policy.decide(view(STANDARD, predicted=60.0)) == "primary"  # not degradable
    assert policy.decide(view(STANDARD, circuit_open=True)) == "primary"
    assert policy.decide(view(predicted=60.0, fallback_ready=False)) == "primary"
    assert policy.decide(view(predicted=60.0, fallback=None)) == "primary"
    assert policy.decide(view(BATCH, predicted=60.0)) == "primary"  # no TTFT target to break
    assert policy.decide(view(BATCH, circuit_open=True, predicted=None)) == "fallback"
    relaxed = DegradeOnSlo(
        DegradeOnSloParams(safety=1.0, unknown_is_late=False, require_faster_fallback=False)
    )
    assert relaxed.decide(view(predicted=0.9)) == "primary"
    assert relaxed.decide(view(predicted=1.01, fallback_predicted=None)) == "fallback"
    assert relaxed.decide(view(predicted=None)) == "primary"


def worker(*, waiting: int | None, in_flight: int = 0, step_ms: float | None, seqs: int = 4) -> WorkerView:
    return WorkerView(
        worker_id="w",
        model="big",
        state="ready",
        max_num_seqs=seqs,
        num_in_flight=in_flight,
        num_running=None if waiting is None else seqs,
        num_waiting=waiting,
        step_time_ema_ms=step_ms,
    )


def test_the_predictor_adds_the_admission_wait_and_the_shortest_worker_queue() -> None:
    busy = worker(waiting=3, step_ms=100.0)  # (3 + 1) × 0.1 s
    idle = worker(waiting=0, step_ms=50.0)  # (0 + 1) × 0.05 s
    assert worker_queue_s([busy]) == pytest.approx(0.4)
    assert worker_queue_s([busy, idle]) == pytest.approx(0.05)
    assert predict_ttft_s(2.0, [busy, idle]) == pytest.approx(2.05)
    assert predict_ttft_s(None, [busy]) is None  # must queue and nothing drained lately: unknown
    assert predict_ttft_s(0.0, []) is None  # no ready worker
    assert predict_ttft_s(0.0, [worker(waiting=None, step_ms=None)]) == 0.0  # nothing reported yet
    # Our own count shows a queue the last heartbeat has not: 7 sent to a 4-sequence worker.
    assert worker_queue_s([worker(waiting=0, in_flight=7, step_ms=10.0)]) == pytest.approx(0.04)


def test_registered_by_name_with_typed_params() -> None:
    assert isinstance(load_policy("degradation", "never"), Never)
    policy = load_policy("degradation", "degrade-on-slo", {"safety": "0.5"})
    assert isinstance(policy, DegradeOnSlo) and policy.params.safety == 0.5
    with pytest.raises(PolicyError, match=r"policies\.degradation\.params: .*safety"):
        load_policy("degradation", "degrade-on-slo", {"safety": 0})
    with pytest.raises(PolicyError, match="unknown field `margin`"):
        load_policy("degradation", "degrade-on-slo", {"margin": 0.1})
