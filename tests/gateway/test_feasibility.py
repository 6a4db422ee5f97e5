"""Feasibility at the gateway: one log line per tier when a worker process registers, and the gauge."""

from __future__ import annotations

import logging

import pytest

from gateway.feasibility import FeasibilityLog, feasible_by_tier
from gateway.workers import WorkerRegistry, WorkerState
from tests.wire.registers import cpu_register
from wire.messages import Register
from wire.tier import DEFAULT_TIERS


def register(worker_id: str, decode_ms: float | None, *, model: str = "m", pid: int = 1) -> Register:
    prefill_ms = None if decode_ms is None else 1.0
    return cpu_register(
        worker_id, model=model, pid=pid, step_floor_ms=decode_ms, prefill_ms_per_token=prefill_ms
    )


def test_each_worker_process_is_reported_once_and_an_infeasible_tier_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = WorkerRegistry()
    report = FeasibilityLog(DEFAULT_TIERS, registry)
    registry.on_register(register("slow", 150.0), 0.0)
    registry.on_register(register("unmeasured", None), 0.0)
    with caplog.at_level(logging.INFO, logger="gateway.feasibility"):
        report()
        report()  # nothing new: nothing logged again
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(lines) == 3  # one per tier of the measured worker
    warnings = [m for level, m in lines if level == logging.WARNING]
    assert len(warnings) == 1 and "worker slow (m): tier 'interactive'" in warnings[0]
    caplog.clear()
    registry.on_register(register("slow", 150.0, pid=2), 1.0)  # restarted: measured again
    with caplog.at_level(logging.INFO, logger="gateway.feasibility"):
        report()
    assert len(caplog.records) == 3


def test_the_gauge_is_1_when_any_live_worker_of_the_model_meets_the_tier() -> None:
    registry = WorkerRegistry()
    registry.on_register(register("slow", 150.0), 0.0)
    assert feasible_by_tier(DEFAULT_TIERS, registry)[("m", "interactive")] is False
    registry.on_register(register("fast", 6.0), 0.0)
    verdicts = feasible_by_tier(DEFAULT_TIERS, registry)
    assert verdicts[("m", "interactive")] is True and verdicts[("m", "batch")] is True
    fast = registry.get("fast")
    assert fast is not None
    fast.state = WorkerState.DEAD
    assert feasible_by_tier(DEFAULT_TIERS, registry)[("m", "interactive")] is False
    assert feasible_by_tier(DEFAULT_TIERS, WorkerRegistry()) == {}
