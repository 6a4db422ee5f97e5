"""Built-in orderings: ``fcfs`` (the baseline) and ``tiered`` (tiers, then fairness between tenants,
in the order and on the sequence slots)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from policies.base import NoParams, SeqView
from policies.tenant_service import TenantService, slot_shares


class Fcfs:
    """First come, first served: by arrival time, whatever the tier."""

    kind: ClassVar[str] = "ordering"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        pass

    def order(self, requests: Sequence[SeqView], now: float) -> list[SeqView]:
        return sorted(requests, key=lambda r: r.arrival_time)


class TieredParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The tenant counters' weights (both 0: no fairness, every counter stays 0) and how long an idle
    tenant's counter is kept."""

    input_weight: Annotated[float, msgspec.Meta(ge=0)] = 1.0  # per prompt token computed
    output_weight: Annotated[float, msgspec.Meta(ge=0)] = 2.0  # per token generated (VTC's default)
    forget_after_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0


class Tiered:
    """Most urgent tier first (lowest rank), then lowest ``priority``; within those the tenant with
    the least service first (``policies.tenant_service``), then the earliest TTFT deadline (None
    last), then arrival.

    Invariants beyond the Protocol's: a request never comes after one of a less urgent tier, nor
    after one of its tier with a larger ``priority``. With one tenant the order is (tier, priority, deadline,
    arrival) exactly. Each request placed charges its tenant, for this call only, what it would cost
    this step, so one tenant's fifty requests interleave with another's one rather than all going first.

    Slots (:class:`~policies.base.SlotSharing`): when every sequence slot is taken, a waiting request
    whose tenant holds fewer than its fair share of its tier's slots (``max_num_seqs``, less those of
    more urgent tiers, over the tier's tenants with requests in the worker) may take the slot of a
    running request of that tier whose tenant holds more than its share, if both are still within
    their shares after the swap (so a swap is never undone). Order alone cannot do it: a light
    tenant's request, first in the order, would otherwise wait for one of the heavy tenant's
    requests to finish. Off with both weights 0.
    """

    kind: ClassVar[str] = "ordering"
    Params = TieredParams

    def __init__(self, params: TieredParams) -> None:
        self.params = params
        self.service = TenantService(params.input_weight, params.output_weight, params.forget_after_s)

    def order(self, requests: Sequence[SeqView], now: float) -> list[SeqView]:
        self.service.observe(requests, now)
        base = sorted(requests, key=_urgency)
        if self.service.num_active_tenants <= 1:
            return base  # one tenant's tags rise along ``base``: sorting by them changes nothing
        tags = self.service.tags(base)
        # Ties on the tag go by position in ``base``: deadline, arrival, then input order.
        keys = sorted(
            zip((r.tier_rank for r in base), (r.priority for r in base), tags, range(len(base)), strict=True)
        )
        return [base[k[3]] for k in keys]

    def slot_donors(
        self, request: SeqView, running: Sequence[SeqView], waiting: Sequence[SeqView], max_num_seqs: int
    ) -> list[SeqView]:
        if self.params.input_weight == 0 and self.params.output_weight == 0:
            return []
        rank = request.tier_rank
        shares = slot_shares(rank, running, waiting, max_num_seqs, request)
        if shares.over(request.tenant, extra=1):
            return []
        # donors stay within their share after the swap (n − 1 ≥ share), so a swap is never undone
        over = {t for t, n in shares.held.items() if t != request.tenant and n - 1 >= shares.share}
        return [r for r in running if r.tier_rank == rank and r.tenant in over]


def _urgency(r: SeqView) -> tuple[int, int, float, float]:
    deadline = r.ttft_deadline
    return (r.tier_rank, r.priority, math.inf if deadline is None else deadline, r.arrival_time)
