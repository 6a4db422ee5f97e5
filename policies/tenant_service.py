"""Each tenant's virtual service counter: weighted tokens served, as in the Virtual Token Counter
(Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

``observe`` is shown every live request of the worker once per step; it charges each request's growth
since the previous call to its tenant: ``input_weight`` per prompt (or recomputed) token computed and
``output_weight`` per token generated. A drop in computed tokens is a preemption: nothing is charged,
counting starts again from there (the recomputation is service too). A request absent from a call has
finished and is forgotten; a tenant with no request for ``forget_after_s`` is forgotten too. A tenant
that (re)appears starts at no less than the least counter among the tenants active in the previous
call (VTC's lift): being idle does not bank credit. Tenant ``None`` (no tenant) is one tenant.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from policies.base import SeqView


class TenantService:
    """The counters (``counter(tenant)``) and the per-request progress they are charged from."""

    def __init__(self, input_weight: float, output_weight: float, forget_after_s: float) -> None:
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.forget_after_s = forget_after_s
        self._counters: dict[str | None, float] = {}
        self._last_active: dict[str | None, float] = {}  # tenant → when it last had a request
        self._active: set[str | None] = set()  # tenants with requests in the latest call
        self._progress: dict[str, tuple[int, int]] = {}  # request id → (computed, output) tokens seen

    def counter(self, tenant: str | None) -> float:
        return self._counters.get(tenant, 0.0)

    @property
    def num_tenants(self) -> int:
        """Tenants remembered (active within ``forget_after_s``)."""
        return len(self._counters)

    @property
    def num_requests(self) -> int:
        """Requests whose progress is remembered: those of the latest call."""
        return len(self._progress)

    @property
    def num_active_tenants(self) -> int:
        """Tenants with requests in the latest call."""
        return len(self._active)

    def step_cost(self, r: SeqView) -> float:
        """The tentative charge of serving ``r`` this step: its tokens left to compute, one token out."""
        remaining = r.num_tokens - r.num_computed_tokens
        return self.output_weight + (self.input_weight * (remaining - 1) if remaining > 1 else 0.0)

    def tags(self, ordered: Sequence[SeqView]) -> list[float]:
        """Per request, its tenant's counter plus the step costs of that tenant's requests before it in
        ``ordered``: sorting by tag merges the tenants' queues, the least served first."""
        tentative: dict[str | None, float] = {}
        out = []
        for r in ordered:
            tenant = r.tenant
            tag = tentative[tenant] if tenant in tentative else self._counters.get(tenant, 0.0)
            out.append(tag)
            tentative[tenant] = tag + self.step_cost(r)
        return out

    def observe(self, requests: Sequence[SeqView], now: float) -> None:
        """Charge what each request computed since the previous call; lift (re)appearing tenants."""
        counters, previous = self._counters, self._progress
        w_in, w_out = self.input_weight, self.output_weight
        floor = min((counters[t] for t in self._active), default=min(counters.values(), default=0.0))
        progress: dict[str, tuple[int, int]] = {}
        active: set[str | None] = set()
        for r in requests:
            tenant = r.tenant
            if tenant not in active:
                active.add(tenant)
                if tenant not in self._active:
                    counters[tenant] = max(counters.get(tenant, floor), floor)
            computed, outputs = r.num_computed_tokens, r.num_output_tokens
            seen = previous.get(r.request_id)
            if seen is not None:
                new_outputs = outputs - seen[1]  # never negative: outputs only grow
                # A decode computes the previous output token: that growth is the output, not input.
                # Computed tokens drop on a preemption: then nothing is charged.
                new_inputs = computed - seen[0] - new_outputs
                if new_inputs > 0 or new_outputs > 0:
                    counters[tenant] += w_in * max(new_inputs, 0) + w_out * new_outputs
            progress[r.request_id] = (computed, outputs)
        self._progress = progress
        self._active = active
        for tenant in active:
            self._last_active[tenant] = now
        if len(self._last_active) > len(active):
            for tenant in [t for t, at in self._last_active.items() if now - at > self.forget_after_s]:
                del self._last_active[tenant], counters[tenant]


@dataclass(frozen=True, slots=True)
class SlotShares:
    """How one tier's sequence slots are held: ``held`` per tenant among the running requests of
    the tier, and ``share``, each tenant's fair part: ``max_num_seqs`` less the slots of more urgent
    tiers, over the tier's tenants with requests in the worker (running or waiting)."""

    held: dict[str | None, int]
    share: float

    def over(self, tenant: str | None, extra: int = 0) -> bool:
        """Whether ``tenant`` holds more than its share (with ``extra`` more slots)."""
        return self.held.get(tenant, 0) + extra > self.share


def slot_shares(
    rank: int,
    running: Sequence[SeqView],
    waiting: Sequence[SeqView],
    max_num_seqs: int,
    also: SeqView | None = None,
    recent: Iterable[str | None] = (),
) -> SlotShares:
    """The slot shares of tier ``rank``, counting ``also``'s tenant and the ``recent`` ones (seen
    lately, with no request in the worker now) among its tenants."""
    held: dict[str | None, int] = {}
    num_urgent = 0
    for r in running:
        if r.tier_rank == rank:
            held[r.tenant] = held.get(r.tenant, 0) + 1
        num_urgent += r.tier_rank < rank
    tenants = set(held) | {r.tenant for r in waiting if r.tier_rank == rank} | set(recent)
    if also is not None:
        tenants.add(also.tenant)
    return SlotShares(held, (max_num_seqs - num_urgent) / max(1, len(tenants)))
