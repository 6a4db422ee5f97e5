"""``ordering.short-first``: within a tier, the request with the fewest tokens left to compute first,
so a short chat turn is not queued behind a long document's prefill (shortest job first lowers the
mean time to first token), with aging so a long prompt is never starved.

Key, lowest first: the tier rank, the request's ``priority``, then requests that have waited at least
``max_wait_s`` since arrival (by arrival), then the rest by tokens left to compute (a running decode
has one left, a waiting prompt all of its tokens), then arrival. It keeps no state: the aging comes
from ``now`` and each request's ``arrival_time``, both on the worker's monotonic clock.

Tenants are not its business: the built-in ``tiered`` ordering already shares a tier fairly between
tenants; this one trades that for shorter queues of short requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from policies.base import SeqView


class ShortFirstParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_wait_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0  # waited this long: ahead of shorter ones


class ShortFirst:
    """Fewest tokens left first within a tier and priority; overdue requests before all of those."""

    kind: ClassVar[str] = "ordering"
    Params = ShortFirstParams

    def __init__(self, params: ShortFirstParams) -> None:
        self.params = params

    def order(self, requests: Sequence[SeqView], now: float) -> list[SeqView]:
        max_wait_s = self.params.max_wait_s

        def key(r: SeqView) -> tuple[int, int, bool, int, float]:
            is_overdue = now - r.arrival_time >= max_wait_s
            left = 0 if is_overdue else r.num_tokens - r.num_computed_tokens
            return (r.tier_rank, r.priority, not is_overdue, left, r.arrival_time)

        return sorted(requests, key=key)
