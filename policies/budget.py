"""Built-in step budgets: ``static`` (the configured ceilings, the baseline) and ``slo-budget``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from policies.base import NoParams, SeqView, StepBudget, StepLimits, StepReport


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


class StepTimeModel:
    """Step time ≈ fixed + per_token · new tokens + per_context · context tokens attended, in ms.

    Fitted online by recursive least squares with exponential forgetting (recent steps weigh more, so
    the model follows the machine's load), starting from a prior. Coefficients are kept non-negative.
    """

    __slots__ = ("_forget", "_p", "theta")

    def __init__(
        self, prior: tuple[float, float, float], forget: float = 0.98, confidence: float = 10.0
    ) -> None:
        self.theta = list(prior)
        self._forget = forget
        # Covariance of the estimate: small = trust the prior. Scaled per column to its units.
        self._p = [[confidence if i == j else 0.0 for j in range(3)] for i in range(3)]
        self._p[1][1] = confidence * 1e-4
        self._p[2][2] = confidence * 1e-7

    def predict(self, num_tokens: float, num_context: float) -> float:
        a, b, c = self.theta
        return a + b * num_tokens + c * num_context

    def update(self, num_tokens: float, num_context: float, elapsed_ms: float) -> None:
        x = (1.0, float(num_tokens), float(num_context))
        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        denominator = self._forget + sum(x[i] * px[i] for i in range(3))
        if not denominator > 0 or not math.isfinite(elapsed_ms):
            return
        gain = [v / denominator for v in px]
        error = elapsed_ms - self.predict(num_tokens, num_context)
        self.theta = [max(0.0, t + g * error) for t, g in zip(self.theta, gain, strict=True)]
        self._p = [[(p[i][j] - gain[i] * px[j]) / self._forget for j in range(3)] for i in range(3)]


class SloBudgetParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    safety: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8  # aim for this fraction of the TPOT target
    min_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8  # a step always holds at least this many
    fixed_ms: Annotated[float, msgspec.Meta(ge=0)] = 10.0  # priors for the step-time model
    per_token_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    per_context_token_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0005
    forget: Annotated[float, msgspec.Meta(gt=0.5, le=1)] = 0.98


class SloBudget:
    """Caps each step so the strictest TPOT target among running and waiting requests holds.

    With a target ``T`` (ms) in force, the step may hold ``n`` new tokens where
    ``fixed + per_token·n + per_context·C <= safety·T``, ``C`` being the context the running requests
    attend over. Under the ``tiered`` ordering the most urgent requests take the step first, so it is
    the lower tiers that wait (or are preempted) rather than the interactive streams slowing down.
    With no target in force the budget is the configured ceiling. The model learns from every step.
    """

    kind: ClassVar[str] = "budget"
    Params = SloBudgetParams

    def __init__(self, params: SloBudgetParams) -> None:
        self.params = params
        self.model = StepTimeModel(
            (params.fixed_ms, params.per_token_ms, params.per_context_token_ms), forget=params.forget
        )

    def target_ms(self, running: Sequence[SeqView], waiting: Sequence[SeqView]) -> float | None:
        targets = [r.tpot_ms for r in (*running, *waiting) if r.tpot_ms is not None]
        return min(targets) * self.params.safety if targets else None

    def budget(
        self, running: Sequence[SeqView], waiting: Sequence[SeqView], limits: StepLimits
    ) -> StepBudget:
        target = self.target_ms(running, waiting)
        if target is None:
            return StepBudget(limits.max_num_batched_tokens, limits.max_num_seqs)
        a, b, c = self.model.theta
        context = sum(r.num_tokens for r in running)
        room = target - a - c * context
        num_tokens = int(room / b) if b > 0 else limits.max_num_batched_tokens
        num_tokens = max(self.params.min_tokens, min(num_tokens, limits.max_num_batched_tokens))
        return StepBudget(num_tokens, limits.max_num_seqs)

    def observe(self, report: StepReport) -> None:
        if report.num_tokens > 0:
            self.model.update(report.num_tokens, report.num_context_tokens, report.elapsed_ms)
