"""Built-in step budgets: ``static`` (the configured ceilings, the baseline) and ``slo-budget``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from policies.base import NoParams, SeqView, StepBudget, StepLimits, StepReport
from policies.step_time import StepCost, StepTimeLimit, StepTimeModel


class Static:
    """Every step may hold what the engine is configured for."""

    kind: ClassVar[str] = "budget"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        pass

    def budget(
        self, running: Sequence[SeqView], waiting: Sequence[SeqView], limits: StepLimits
    ) -> StepBudget:
        return StepBudget(limits.max_num_batched_tokens, limits.max_num_seqs)

    def observe(self, report: StepReport) -> None:
        pass


class SloBudgetParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    safety: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8  # aim for this fraction of the TPOT target
    # Never cap a step below this many times the one-decode step (fixed + per_decode): when a
    # target is that tight (or infeasible on this machine), the tier gets steps as short as
    # this, and the others still progress beside it.
    min_step_factor: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    # Priors of the step-time model (policies.step_time), refined by every step the worker runs.
    fixed_ms: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    per_decode_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    per_prefill_token_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    per_context_token_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0005
    forget: Annotated[float, msgspec.Meta(gt=0.5, le=1)] = 0.98


class SloBudget:
    """Caps each step's predicted time so the strictest TPOT target among running and waiting
    requests holds.

    With a target ``T`` (ms) in force the step gets a time limit of ``max(safety·T,
    min_step_factor·floor)`` (``floor``: a step of one decode, from the fitted model) and the
    scheduler fills it in the ordering's order: under ``tiered`` the urgent decodes and prefill
    chunks go in first and only what fits beside them follows (batch decodes sit the step out,
    keeping their KV; a prefill chunk is shortened). The step's cost is predicted by its
    composition (decodes, prefill tokens, context), so steps are never cut below what the target
    allows. No target in force: the configured ceilings. The model learns from every step.
    """

    kind: ClassVar[str] = "budget"
    Params = SloBudgetParams

    def __init__(self, params: SloBudgetParams) -> None:
        self.params = params
        prior = StepCost(
            params.fixed_ms, params.per_decode_ms, params.per_prefill_token_ms, params.per_context_token_ms
        )
        self.model = StepTimeModel(prior, forget=params.forget)

    def target_ms(self, running: Sequence[SeqView], waiting: Sequence[SeqView]) -> float | None:
        """The strictest TPOT target in force (ms), None for none."""
        targets = [r.tpot_ms for r in (*running, *waiting) if r.tpot_ms is not None]
        return min(targets) if targets else None

    def budget(
        self, running: Sequence[SeqView], waiting: Sequence[SeqView], limits: StepLimits
    ) -> StepBudget:
        target = self.target_ms(running, waiting)
        if target is None:
            return StepBudget(limits.max_num_batched_tokens, limits.max_num_seqs)
        cost = self.model.cost
        max_ms = max(self.params.safety * target, self.params.min_step_factor * cost.floor_ms)
        return StepBudget(limits.max_num_batched_tokens, limits.max_num_seqs, StepTimeLimit(cost, max_ms))

    def observe(self, report: StepReport) -> None:
        if report.num_tokens > 0:
            self.model.update(
                report.num_decodes, report.num_prefill_tokens, report.num_context_tokens, report.elapsed_ms
            )
