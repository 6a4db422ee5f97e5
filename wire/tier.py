"""The SLA tier: one contract that every layer reads (gateway admission, worker scheduling, metrics)."""

from __future__ import annotations

import msgspec


class Tier(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An SLA tier. ``rank`` 0 is the most urgent; ``None`` latency targets mean "no SLO".

    The gateway resolves a request's tier once; the same Struct travels in Submit, so the worker
    schedules and evicts by exactly what the gateway admitted.
    """

    name: str
    rank: int
    ttft_ms: float | None = None  # time to first token target
    tpot_ms: float | None = None  # time per output token target (first token excluded)
    deadline_s: float | None = None  # whole-request deadline, for batch-like tiers
    max_queue: int = 256  # requests waiting at the gateway before it sheds
    sheddable: bool = False  # shed first under overload
    degradable: bool = False  # may be sent to the fallback (smaller) model pool


DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier(name="interactive", rank=0, ttft_ms=1000.0, tpot_ms=100.0, max_queue=128),
    Tier(name="standard", rank=1, ttft_ms=3000.0, tpot_ms=200.0, max_queue=256),
    Tier(name="batch", rank=2, max_queue=1024, sheddable=True),
)

# OpenAI's ``service_tier`` values that may name a tier (``auto``, no preference, always means the
# header's or the tenant's tier), in the order a response names a tier mapped from several.
OPENAI_SERVICE_TIERS = ("default", "priority", "flex", "scale", "fast")
