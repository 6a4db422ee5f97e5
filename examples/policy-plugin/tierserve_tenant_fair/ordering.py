"""``ordering.tenant-fair``: tenants share the engine by tokens served, in the spirit of the Virtual
Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

Each tenant has a counter of the service it has received: ``input_weight`` per prompt token computed
plus ``output_weight`` per token generated. Each step the requests are ordered so that the tenant with
the least service goes first, one request at a time: after placing a request its tenant's counter is
charged (for this ordering only) with what that request would cost this step, so one tenant with fifty
requests does not take a whole step ahead of a tenant with one. Within a tenant, requests go in arrival
order.

Tiers: by default (``respect_tiers = true``) the tier rank comes first and fairness applies within a
tier, so an interactive request never waits behind a batch one whatever its tenant has used. With
``respect_tiers = false`` tenants are ordered by service alone and tiers are ignored.

A tenant that comes back after being idle starts from the smallest counter among the tenants active
now (VTC's "lift"): being idle does not bank credit to spend later. Requests without a tenant share one
anonymous tenant.

How service is counted: the ordering sees every request of the worker each step (running and waiting),
remembers per request the computed and output token counts it last saw, and charges the growth to the
request's tenant. A preempted request's recomputation is service too (it used the engine). State is kept
per request id (numbers only, no reference to the request) and forgotten ``forget_after_s`` after a
request was last seen.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

import msgspec

from policies.base import SeqView

ANONYMOUS = ""


class TenantFairParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    respect_tiers: bool = True  # order by tier rank first, fairness within a tier
    input_weight: Annotated[float, msgspec.Meta(ge=0)] = 1.0  # service per prompt token computed
    output_weight: Annotated[float, msgspec.Meta(ge=0)] = 2.0  # service per token generated
    forget_after_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0  # drop a request unseen this long


@dataclass(slots=True)
class _Seen:
    tenant: str
    num_computed_tokens: int
    num_output_tokens: int
    last_seen: float


class TenantFair:
    """The tenant with the least weighted tokens served first (see the module docstring)."""

    kind: ClassVar[str] = "ordering"
    Params = TenantFairParams

    def __init__(self, params: TenantFairParams) -> None:
        if params.input_weight == 0 and params.output_weight == 0:
            raise ValueError("input_weight and output_weight cannot both be 0: nothing would be counted")
        self.params = params
        self.service: dict[str, float] = {}  # tenant → weighted tokens served
        self._seen: dict[str, _Seen] = {}  # request id → what we last saw of it

    def order(self, requests: Sequence[SeqView], now: float) -> list[SeqView]:
        self._account(requests, now)
        tentative = dict(self.service)
        groups: dict[tuple[int, str], list[SeqView]] = {}
        for r in sorted(requests, key=lambda r: r.arrival_time):
            rank = r.tier_rank if self.params.respect_tiers else 0
            groups.setdefault((rank, _tenant(r)), []).append(r)

        ordered: list[SeqView] = []
        for rank in sorted({rank for rank, _ in groups}):
            queues = {tenant: reqs for (r, tenant), reqs in groups.items() if r == rank}
            heap = [(tentative.get(tenant, 0.0), tenant) for tenant in queues]
            heapq.heapify(heap)
            while heap:
                _, tenant = heapq.heappop(heap)
                request = queues[tenant].pop(0)
                ordered.append(request)
                tentative[tenant] = tentative.get(tenant, 0.0) + self._step_cost(request)
                if queues[tenant]:
                    heapq.heappush(heap, (tentative[tenant], tenant))
        return ordered

    @property
    def num_tracked_requests(self) -> int:
        """Requests whose counts are remembered (seen within ``forget_after_s``)."""
        return len(self._seen)

    def _step_cost(self, r: SeqView) -> float:
        """What serving ``r`` this step would add to its tenant's counter: its remaining prompt (or
        recomputation) and one token out."""
        remaining = max(1, r.num_tokens - r.num_computed_tokens)
        return self.params.input_weight * (remaining - 1) + self.params.output_weight

    def _account(self, requests: Sequence[SeqView], now: float) -> None:
        p = self.params
        for r in requests:
            tenant = _tenant(r)
            seen = self._seen.get(r.request_id)
            if seen is None:
                if tenant not in self.service or not self._is_active(tenant):
                    self.service[tenant] = max(self.service.get(tenant, 0.0), self._lift())
                self._seen[r.request_id] = _Seen(tenant, r.num_computed_tokens, r.num_output_tokens, now)
                continue
            new_outputs = max(0, r.num_output_tokens - seen.num_output_tokens)
            computed = r.num_computed_tokens - seen.num_computed_tokens
            # A drop in computed tokens is a preemption: nothing to charge, count again from there.
            new_inputs = max(0, computed - new_outputs)
            self.service[tenant] += p.input_weight * new_inputs + p.output_weight * new_outputs
            seen.num_computed_tokens = r.num_computed_tokens
            seen.num_output_tokens = r.num_output_tokens
            seen.last_seen = now
        stale = [rid for rid, s in self._seen.items() if now - s.last_seen > p.forget_after_s]
        for rid in stale:
            del self._seen[rid]

    def _is_active(self, tenant: str) -> bool:
        return any(s.tenant == tenant for s in self._seen.values())

    def _lift(self) -> float:
        """The least service among tenants with requests now: where a returning tenant starts."""
        active = {s.tenant for s in self._seen.values()}
        return min((self.service[t] for t in active), default=0.0)


def _tenant(r: SeqView) -> str:
    return ANONYMOUS if r.tenant is None else r.tenant
