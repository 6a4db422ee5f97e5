"""Whether the fleet can meet each tier's targets, from the step floor each worker measured at start.

Each worker's Register carries its floor (worker/calibrate.py); when a worker process registers for
the first time this logs one line per tier of its model (a warning for a tier it cannot meet even
alone), and :func:`feasible_by_tier` is what ``tierserve_tier_slo_feasible{model,tier}`` shows: 1
when some live worker of the model meets the tier, 0 when none does (no series before any worker
has measured). The verdict itself is policies/feasibility.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from gateway.workers import WorkerInfo, WorkerState
from policies.feasibility import StepFloor, TierFeasibility, assess
from wire.tier import Tier

log = logging.getLogger(__name__)


def floor_of(worker: WorkerInfo) -> StepFloor | None:
    register = worker.register
    if register.step_floor_ms is None or register.prefill_ms_per_token is None:
        return None
    return StepFloor(register.step_floor_ms, register.prefill_ms_per_token)


class FeasibilityLog:
    """Logs each worker process's verdicts once (a dispatcher listener: called on every change)."""

    def __init__(self, tiers: Sequence[Tier], workers: Iterable[WorkerInfo]) -> None:
        self.tiers = tuple(tiers)
        self.workers = workers
        self._seen: set[tuple[str, int]] = set()

    def __call__(self) -> None:
        for worker in self.workers:
            key = (worker.worker_id, worker.register.pid)
            floor = floor_of(worker)
            if key in self._seen or floor is None:
                continue
            self._seen.add(key)
            for verdict in assess(self.tiers, floor):
                level = logging.INFO if verdict.is_feasible else logging.WARNING
                log.log(level, "worker %s (%s): %s", worker.worker_id, worker.model, verdict.describe())


def feasible_by_tier(tiers: Sequence[Tier], workers: Iterable[WorkerInfo]) -> dict[tuple[str, str], bool]:
    """``{(model, tier): whether some live measured worker of the model meets the tier}``."""
    verdicts: dict[tuple[str, str], bool] = {}
    for worker in workers:
        floor = floor_of(worker)
        if floor is None or worker.state is WorkerState.DEAD:
            continue
        for verdict in assess(tiers, floor):
            key = (worker.model, verdict.tier.name)
            verdicts[key] = verdicts.get(key, False) or verdict.is_feasible
    return verdicts


__all__ = ["FeasibilityLog", "TierFeasibility", "feasible_by_tier", "floor_of"]
