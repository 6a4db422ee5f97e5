"""What a step costs: the linear cost by composition, the time limit a budget sets, and the fitted model.

    step ms ≈ fixed + per_decode · decodes + per_prefill_token · prefill tokens + per_context · context

``context`` is the sum over the step's requests of their context after it (what each one attends
over). A budget may hand the scheduler a :class:`StepTimeLimit` (a cost and a ceiling in ms); the
scheduler then adds requests in the ordering's order while the predicted time stays under the ceiling:
a decode that does not fit sits the step out (keeping its KV), a prefill chunk is shortened to fit.
Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StepCost:
    """The four terms of the linear step cost, in ms (each at least 0)."""

    fixed_ms: float
    per_decode_ms: float
    per_prefill_token_ms: float
    per_context_token_ms: float

    def predict(self, num_decodes: float, num_prefill_tokens: float, num_context: float) -> float:
        return (
            self.fixed_ms
            + self.per_decode_ms * num_decodes
            + self.per_prefill_token_ms * num_prefill_tokens
            + self.per_context_token_ms * num_context
        )

    def decode_ms(self, context_after: int) -> float:
        """What one more decode adds to a step."""
        return self.per_decode_ms + self.per_context_token_ms * context_after

    def chunk_ms(self, num_tokens: int, context_before: int) -> float:
        """What a prefill chunk of ``num_tokens`` after ``context_before`` computed tokens adds."""
        return self.per_prefill_token_ms * num_tokens + self.per_context_token_ms * (
            context_before + num_tokens
        )

    def chunk_tokens_within(self, ms: float, context_before: int) -> int:
        """The longest prefill chunk that adds at most ``ms`` (0 if none does)."""
        room = ms - self.per_context_token_ms * context_before
        per_token = self.per_prefill_token_ms + self.per_context_token_ms
        if room <= 0:
            return 0
        return int(room / per_token) if per_token > 0 else 1 << 30

    @property
    def floor_ms(self) -> float:
        """A step of one short decode: the least any step with a decode costs."""
        return self.fixed_ms + self.per_decode_ms


@dataclass(frozen=True, slots=True)
class StepTimeLimit:
    """A ceiling on one step's predicted time. The step's first request always runs (progress; a
    prefill chunk of it is still cut to fit, to no less than the scheduler's minimum chunk).

    ``first_token_ms`` lengthens the step for requests whose first token is due: such a request's
    tokens may take the step on to its own ceiling there (typically its whole remaining prefill
    beside the streams' decodes), and once it is in the step, so may the tokens of everyone after
    it in the order; before it, everyone's stay within ``max_ms``. Which due request gets the time
    is the ordering's say (whichever comes first); the time is not spent on others' prefill chunks
    that come before it."""

    cost: StepCost
    max_ms: float
    first_token_ms: Mapping[str, float] = field(default_factory=dict)


MIN_CHUNK_TOKENS = 16  # a prefill chunk a time limit cuts shorter than this waits for the next step

TOKEN_SCALE = 256.0  # features are fitted in these units, so all four are of order 1
CONTEXT_SCALE = 16384.0
_SCALES = (1.0, 64.0, TOKEN_SCALE, CONTEXT_SCALE)


class StepTimeModel:
    """:class:`StepCost` fitted online: least squares over the steps seen, recent ones weighing more
    (exponential forgetting), every coefficient at least 0, anchored to a prior.

    Recent steps weigh more, so the model follows the machine's load. Kept in information form: ``R``
    (the weighted sum of ``x xᵀ``) and ``r`` (of ``x · elapsed``), features scaled to order 1. Each
    step forgets a fraction ``1 − forget`` of both and adds the same fraction of the prior
    (stabilized forgetting): a worker under a steady load repeats one kind of step (8 decodes, no
    prefill, for minutes), which says what that step costs but not how to split it between the fixed
    part and the per-decode one; plain forgetting would let that split drift anywhere (and the
    covariance wind up), so a 1-decode step would be predicted at 45 ms that costs 6. Here the split
    the data does not determine stays the prior's. The coefficients are the non-negative least
    squares solution (a small active-set solve, cached until the next step), so what is read is what
    was fitted: predictions stay right when a coefficient is pinned at 0.
    """

    __slots__ = ("_forget", "_prior_info", "_prior_r", "_r", "_r_vec", "_theta")

    def __init__(self, prior: StepCost, forget: float = 0.98, confidence: float = 100.0) -> None:
        terms = (prior.fixed_ms, prior.per_decode_ms, prior.per_prefill_token_ms, prior.per_context_token_ms)
        theta0 = [t * s for t, s in zip(terms, _SCALES, strict=True)]
        n = len(_SCALES)
        self._forget = forget
        self._prior_info = 1.0 / confidence  # R0 = I / confidence: the prior's weight, in steps' units
        self._prior_r = [self._prior_info * t for t in theta0]
        self._r = [[self._prior_info if i == j else 0.0 for j in range(n)] for i in range(n)]
        self._r_vec = list(self._prior_r)
        self._theta: list[float] | None = theta0

    @property
    def cost(self) -> StepCost:
        a, d, p, c = (t / s for t, s in zip(self._solved(), _SCALES, strict=True))
        return StepCost(a, d, p, c)

    def predict(self, num_decodes: float, num_prefill_tokens: float, num_context: float) -> float:
        return self.cost.predict(num_decodes, num_prefill_tokens, num_context)

    def update(
        self, num_decodes: float, num_prefill_tokens: float, num_context: float, elapsed_ms: float
    ) -> None:
        if not math.isfinite(elapsed_ms):
            return
        raw = (1.0, num_decodes, num_prefill_tokens, num_context)
        x = [v / s for v, s in zip(raw, _SCALES, strict=True)]
        lam, mix = self._forget, (1.0 - self._forget) * self._prior_info
        n = len(x)
        r = self._r
        for i in range(n):
            row = r[i]
            for j in range(n):
                row[j] = lam * row[j] + x[i] * x[j] + (mix if i == j else 0.0)
        moved = zip(self._r_vec, x, self._prior_r, strict=True)
        self._r_vec = [lam * v + xi * elapsed_ms + (1.0 - lam) * p for v, xi, p in moved]
        self._theta = None

    def _solved(self) -> list[float]:
        if self._theta is None:
            self._theta = _nonnegative_solve(self._r, self._r_vec)
        return self._theta


def _nonnegative_solve(a: list[list[float]], b: list[float]) -> list[float]:
    """argmin over θ ≥ 0 of ``θᵀaθ − 2bᵀθ`` for a symmetric positive definite ``a`` (an active set:
    solve over the free coefficients, pin the most negative at 0, free a pinned one whose gradient
    says it should grow; a few rounds for four unknowns)."""
    n = len(b)
    free = list(range(n))
    theta = [0.0] * n
    for _ in range(4 * n):
        theta = [0.0] * n
        solved = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
        for i, v in zip(free, solved, strict=True):
            theta[i] = v
        negative = [i for i in free if theta[i] < 0]
        if negative:
            free.remove(min(negative, key=lambda i: theta[i]))
            continue
        gradient = [sum(a[i][j] * theta[j] for j in range(n)) - b[i] for i in range(n)]
        pinned = [i for i in range(n) if i not in free and gradient[i] < -1e-12]
        if not pinned:
            break
        free = sorted([*free, min(pinned, key=lambda i: gradient[i])])
    return [max(0.0, t) for t in theta]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a⁻¹ b`` by Gaussian elimination with partial pivoting (``a`` small and positive definite)."""
    n = len(b)
    m = [[*row, v] for row, v in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(m[i][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            continue
        for i in range(col + 1, n):
            factor = m[i][col] / m[col][col]
            if factor:
                for j in range(col, n + 1):
                    m[i][j] -= factor * m[col][j]
    out = [0.0] * n
    for i in reversed(range(n)):
        if m[i][i] != 0.0:
            out[i] = (m[i][n] - sum(m[i][j] * out[j] for j in range(i + 1, n))) / m[i][i]
    return out
