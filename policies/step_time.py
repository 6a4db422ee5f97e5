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
    """:class:`StepCost` fitted online by recursive least squares with exponential forgetting.

    Recent steps weigh more, so the model follows the machine's load; it starts from a prior.
    Numerically careful, because a worker feeds it every step for days: features are scaled to order
    1, the covariance update is the symmetric form, and the covariance is scaled back whenever
    forgetting inflates it past its initial size (steady load repeats one kind of step, which would
    otherwise wind it up without bound). Coefficients are clipped at zero when read, never in the fit.
    """

    __slots__ = ("_forget", "_max_trace", "_p", "_theta")

    def __init__(self, prior: StepCost, forget: float = 0.98, confidence: float = 100.0) -> None:
        terms = (prior.fixed_ms, prior.per_decode_ms, prior.per_prefill_token_ms, prior.per_context_token_ms)
        self._theta = [t * s for t, s in zip(terms, _SCALES, strict=True)]
        self._forget = forget
        n = len(_SCALES)
        self._p = [[confidence if i == j else 0.0 for j in range(n)] for i in range(n)]
        self._max_trace = n * confidence

    @property
    def cost(self) -> StepCost:
        a, d, p, c = (max(0.0, t) / s for t, s in zip(self._theta, _SCALES, strict=True))
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
        n = len(x)
        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denominator = self._forget + sum(x[i] * px[i] for i in range(n))
        if not denominator > 0:
            return
        error = elapsed_ms - sum(t * xi for t, xi in zip(self._theta, x, strict=True))
        self._theta = [t + v / denominator * error for t, v in zip(self._theta, px, strict=True)]
        p = [[(p[i][j] - px[i] * px[j] / denominator) / self._forget for j in range(n)] for i in range(n)]
        trace = sum(p[i][i] for i in range(n))
        if trace > self._max_trace:
            p = [[v * self._max_trace / trace for v in row] for row in p]
        self._p = p
