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


TOKEN_SCALE = 256.0  # features are fitted in these units, so all three are of order 1
CONTEXT_SCALE = 16384.0


class StepTimeModel:
    """Step time ≈ fixed + per_token · new tokens + per_context · context tokens attended, in ms.

    Fitted online by recursive least squares with exponential forgetting (recent steps weigh more, so
    the model follows the machine's load), starting from a prior. Numerically careful, because a
    worker feeds it every step for days: features are scaled to order 1, the covariance update is
    the symmetric form, and the covariance is scaled back whenever forgetting inflates it past its
    initial size (steady load repeats one kind of step, which would otherwise wind it up without
    bound). Coefficients are clipped at zero when read, never in the fit itself.
    """

    __slots__ = ("_forget", "_max_trace", "_p", "_theta")

    def __init__(
        self, prior: tuple[float, float, float], forget: float = 0.98, confidence: float = 100.0
    ) -> None:
        a, b, c = prior
        self._theta = [a, b * TOKEN_SCALE, c * CONTEXT_SCALE]
        self._forget = forget
        self._p = [[confidence if i == j else 0.0 for j in range(3)] for i in range(3)]
        self._max_trace = 3 * confidence

    @property
    def theta(self) -> tuple[float, float, float]:
        """(fixed ms, ms per new token, ms per context token), each at least 0."""
        a, b, c = (max(0.0, t) for t in self._theta)
        return a, b / TOKEN_SCALE, c / CONTEXT_SCALE

    def predict(self, num_tokens: float, num_context: float) -> float:
        a, b, c = self.theta
        return a + b * num_tokens + c * num_context

    def update(self, num_tokens: float, num_context: float, elapsed_ms: float) -> None:
        if not math.isfinite(elapsed_ms):
            return
        x = (1.0, num_tokens / TOKEN_SCALE, num_context / CONTEXT_SCALE)
        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        denominator = self._forget + sum(x[i] * px[i] for i in range(3))
        if not denominator > 0:
            return
        error = elapsed_ms - sum(t * xi for t, xi in zip(self._theta, x, strict=True))
        self._theta = [t + v / denominator * error for t, v in zip(self._theta, px, strict=True)]
        p = [[(p[i][j] - px[i] * px[j] / denominator) / self._forget for j in range(3)] for i in range(3)]
        trace = p[0][0] + p[1][1] + p[2][2]
        if trace > self._max_trace:
            p = [[v * self._max_trace / trace for v in row] for row in p]
        self._p = p


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
        num_tokens = min(max(self.params.min_tokens, num_tokens), limits.max_num_batched_tokens)
        return StepBudget(num_tokens, limits.max_num_seqs)

    def observe(self, report: StepReport) -> None:
        if report.num_tokens > 0:
            self.model.update(report.num_tokens, report.num_context_tokens, report.elapsed_ms)
