"""Built-in step budgets: ``static`` (the configured ceilings, the baseline) and ``slo-budget``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from policies.base import NoParams, SeqView, StepBudget, StepLimits, StepReport
from policies.step_time import MIN_CHUNK_TOKENS, StepCost, StepTimeLimit, StepTimeModel
from policies.tenant_service import SlotShares, slot_shares


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
    # A stream behind its target asks for steps of this fraction of ``safety·T`` while it catches
    # up. Below 1 a loaded worker can fall into a collapse: streams behind shrink every step, each
    # step pays its fixed part for fewer tokens, and everyone falls further behind (32 requests at
    # once, float32, 2-core EPYC: 0.5 gave 85.9 or 53.6 tok/s with TPOT p50 114 or 289 ms, run to
    # run; 1.0 gave 72-78 tok/s at 134-138 ms every time).
    catch_up_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    # With no TPOT target in force (only batch work), steps are still capped at this fraction of
    # the strictest TTFT target seen so far, so an urgent arrival never waits long behind a batch
    # prefill. 0: no cap (the ceilings).
    idle_ttft_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.2
    # The TTFT target assumed until a request with one is seen (the default interactive tier's):
    # the worker learns its tiers from its requests, and the first urgent one must not wait
    # behind a full-size batch step either.
    assumed_ttft_ms: Annotated[float, msgspec.Meta(gt=0)] = 1000.0
    # Priors of the step-time model (policies.step_time), refined by every step the worker runs.
    fixed_ms: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    per_decode_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    per_prefill_token_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    per_context_token_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0005
    forget: Annotated[float, msgspec.Meta(gt=0.5, le=1)] = 0.98
    # Tenant isolation: while two or more tenants of one tier have had requests in the worker within
    # ``shared_window_s``, every step holds the running streams' decodes and at most
    # max((shared_step_factor − 1) · their step, a ``shared_chunk_tokens`` chunk) more, so one
    # tenant's prefill never holds a step long enough for another tenant's arrival to wait it out;
    # a due first token of a tenant within its slot share keeps its whole prefill in one step.
    # 0: no cap.
    shared_step_factor: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    shared_chunk_tokens: Annotated[int, msgspec.Meta(ge=1)] = 32
    shared_window_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0


class SloBudget:
    """Caps each step's predicted time so the TPOT of every running stream holds, and lets the most
    urgent first token through as fast as that allows.

    TPOT is a stream's mean gap, ``(t_last − t_first) / (n − 1)``, so a stream that has run faster
    than its target has time in hand: after ``n`` tokens since ``t_first`` the next step may last
    ``safety·T·n − (now − t_first)`` and the stream still averages ``safety·T`` (a stream behind
    asks for ``catch_up_fraction·safety·T`` while it catches up). The step's limit is

        max(min_step_factor·floor, min(want, the least time in hand of any running stream))

    where ``want`` is ``safety·T`` for the strictest target ``T`` among running and waiting
    requests. A request whose first token is due (its TTFT deadline not yet passed) may take the step
    on to its whole remaining prefill beside the streams' decodes, within the same time in hand
    (``StepTimeLimit.first_token_ms``): one long step instead of a prompt chunked between 80 ms
    steps, when the streams can afford it; before it in the order everyone's tokens stay within the
    plain limit (after it, what is left is anyone's), and which due request gets the time is the
    ordering's say. A due first token is not bounded by the time in hand of the streams of tenants
    of its tier that hold more of the tier's slots than its own (:func:`holding_back`), and any
    first token still to come may have one minimal chunk (``MIN_CHUNK_TOKENS``) beside the streams'
    decodes, so no prompt waits for every stream to end.
    With no TPOT target in force the limit is ``idle_ttft_fraction`` of the strictest TTFT target
    seen so far (``assumed_ttft_ms`` until one is seen), so batch prefill comes in pieces an urgent
    arrival does not wait long behind; ``idle_ttft_fraction = 0`` gives such steps the ceilings.
    While two or more tenants of one tier have had requests within ``shared_window_s``, every step
    is further capped near the running streams' decode step (:meth:`_isolating`), so one tenant's
    prefill is not a step another tenant's arrival waits out.

    The scheduler fills a step in the ordering's order up to the limit: under ``tiered`` the urgent
    decodes and prefill go first, batch decodes that do not fit sit out keeping their KV, a prefill
    chunk is shortened. Step times are predicted by composition (decodes, prefill tokens, context:
    policies.step_time), the model learning from every step; ``floor`` is a one-decode step.
    """

    kind: ClassVar[str] = "budget"
    Params = SloBudgetParams

    def __init__(self, params: SloBudgetParams) -> None:
        self.params = params
        prior = StepCost(
            params.fixed_ms, params.per_decode_ms, params.per_prefill_token_ms, params.per_context_token_ms
        )
        self.model = StepTimeModel(prior, forget=params.forget)
        self.strictest_ttft_ms: float | None = None  # over every request seen (None: none yet)
        self._tenants_seen: dict[int, dict[str | None, float]] = {}  # tier rank → tenant → last seen

    def target_ms(self, running: Sequence[SeqView], waiting: Sequence[SeqView]) -> float | None:
        """The strictest TPOT target in force (ms), None for none."""
        targets = [r.tpot_ms for r in (*running, *waiting) if r.tpot_ms is not None]
        return min(targets) if targets else None

    def budget(
        self, running: Sequence[SeqView], waiting: Sequence[SeqView], limits: StepLimits
    ) -> StepBudget:
        self._remember_ttft((*running, *waiting))
        shared = self._tier_is_shared(running, waiting, limits.now)
        ceilings = StepBudget(limits.max_num_batched_tokens, limits.max_num_seqs)
        target = self.target_ms(running, waiting)
        if target is None and self.params.idle_ttft_fraction == 0 and not shared:
            return ceilings
        if target is None:
            limit = self._idle_limit() if self.params.idle_ttft_fraction > 0 else None
        else:
            limit = self._stream_limit(target, running, waiting, limits)
        if shared:
            limit = self._isolating(limit, running, waiting, limits)
        return StepBudget(ceilings.max_num_tokens, ceilings.max_num_seqs, limit)

    def _idle_limit(self) -> StepTimeLimit:
        """No TPOT target in force: a fraction of the strictest TTFT target seen."""
        cost = self.model.cost
        ttft_ms = self.params.assumed_ttft_ms if self.strictest_ttft_ms is None else self.strictest_ttft_ms
        want = self.params.idle_ttft_fraction * ttft_ms
        return StepTimeLimit(cost, max(self.params.min_step_factor * cost.floor_ms, want))

    def _stream_limit(
        self, target: float, running: Sequence[SeqView], waiting: Sequence[SeqView], limits: StepLimits
    ) -> StepTimeLimit:
        """``safety·target`` within the streams' time in hand, lengthened for due first tokens."""
        cost, now = self.model.cost, limits.now
        streams = [r for r in running if r.tpot_ms is not None and r.first_token_time is not None]
        in_hand = self.time_in_hand_ms(streams, now)
        floor_ms = self.params.min_step_factor * cost.floor_ms
        shared_ms = max(floor_ms, min(self.params.safety * target, in_hand))
        # Each due first token may lengthen the step to its whole prompt beside the streams'
        # decodes, within the time in hand; before it in the order, everyone stays within the plain
        # step (the scheduler's _StepClock opens the rest to those after it).
        # A first token still to come may have one minimal chunk beside the streams' decodes,
        # whatever their time in hand, when it is due, already running, or a slot is free: when
        # the time in hand is shorter than such a step, a prompt would otherwise wait until every
        # stream ended (the running set shrinking as requests finish). A late one waits for a free
        # slot rather than lengthen every step of a full batch.
        first_token_ms: dict[str, float] = {}
        shares: dict[int, SlotShares] = {}
        waiting_ids = {r.request_id for r in waiting}
        slot_free = len(running) < limits.max_num_seqs
        decodes_ms = streams_decode_ms(cost, streams)  # once a step: every candidate's step holds them
        for r in (*running, *waiting):
            if r.first_token_time is not None or r.ttft_deadline is None:
                continue
            is_waiting = r.request_id in waiting_ids
            step_ms = 0.0
            if slot_free or not is_waiting or r.ttft_deadline > now:
                step_ms = first_token_step_ms(cost, decodes_ms, r, MIN_CHUNK_TOKENS)
            if is_due(r, now, late_too=not streams):
                tier = shares.get(r.tier_rank)
                if tier is None:
                    tier = slot_shares(r.tier_rank, running, waiting, limits.max_num_seqs)
                    shares[r.tier_rank] = tier
                bounding = holding_back(r, streams, tier, is_waiting)
                r_in_hand = in_hand if len(bounding) == len(streams) else self.time_in_hand_ms(bounding, now)
                step_ms = max(step_ms, min(first_token_step_ms(cost, decodes_ms, r), r_in_hand))
            if step_ms > shared_ms:
                first_token_ms[r.request_id] = step_ms
        return StepTimeLimit(cost, shared_ms, first_token_ms)

    def _isolating(
        self,
        limit: StepTimeLimit | None,
        running: Sequence[SeqView],
        waiting: Sequence[SeqView],
        limits: StepLimits,
    ) -> StepTimeLimit:
        """``limit`` capped for a tier shared between tenants: a step holds the running streams'
        decodes and at most ``max((shared_step_factor − 1) · their step, a shared_chunk_tokens
        chunk)`` more, so another tenant's arrival waits at most that. A due first token of a tenant
        within its slot share (its own slot counted; the tier's tenants are those seen within
        ``shared_window_s``, requests in the worker or not) may still have its whole prefill beside the
        decodes in one step, within its ceiling from ``limit``: the cap holds back the tenants over
        their share, not it (and the step ends with its prompt, not with others' chunks after it)."""
        cost = self.model.cost
        decoding = [r for r in running if r.first_token_time is not None]
        decodes_ms = streams_decode_ms(cost, decoding)
        decode_step_ms = cost.fixed_ms + decodes_ms
        extra_ms = max(
            (self.params.shared_step_factor - 1) * decode_step_ms,
            cost.chunk_ms(self.params.shared_chunk_tokens, 0),
        )
        cap = max(self.params.min_step_factor * cost.floor_ms, decode_step_ms + extra_ms)
        max_ms = cap if limit is None else min(limit.max_ms, cap)
        waiting_ids = {r.request_id for r in waiting}
        shares: dict[int, SlotShares] = {}
        first_token_ms: dict[str, float] = {}
        for r in (*running, *waiting):
            if r.first_token_time is not None or r.ttft_deadline is None:
                continue
            if limit is None:
                uncapped = first_token_step_ms(cost, decodes_ms, r)
            else:
                uncapped = limit.first_token_ms.get(r.request_id, limit.max_ms)
            ceiling = min(uncapped, cap)
            if uncapped > ceiling and is_due(r, limits.now, late_too=not decoding):
                tier = shares.get(r.tier_rank)
                if tier is None:
                    seen = self._tenants_seen.get(r.tier_rank, {})
                    tier = slot_shares(r.tier_rank, running, waiting, limits.max_num_seqs, recent=seen)
                    shares[r.tier_rank] = tier
                if not tier.over(r.tenant, int(r.request_id in waiting_ids)):
                    ceiling = min(uncapped, max(cap, first_token_step_ms(cost, decodes_ms, r)))
            if ceiling > max_ms:
                first_token_ms[r.request_id] = ceiling
        return StepTimeLimit(cost, max_ms, first_token_ms)

    def _tier_is_shared(self, running: Sequence[SeqView], waiting: Sequence[SeqView], now: float) -> bool:
        """Whether two or more tenants of one tier have had requests within ``shared_window_s``."""
        if self.params.shared_step_factor == 0:
            return False
        for r in (*running, *waiting):
            self._tenants_seen.setdefault(r.tier_rank, {})[r.tenant] = now
        shared = False
        for rank, seen in list(self._tenants_seen.items()):
            for tenant in [t for t, at in seen.items() if now - at > self.params.shared_window_s]:
                del seen[tenant]
            if not seen:
                del self._tenants_seen[rank]
            shared = shared or len(seen) > 1
        return shared

    def time_in_hand_ms(self, streams: Sequence[SeqView], now: float) -> float:
        """How long the next step may last with every stream's mean gap within ``safety`` of its
        target (infinite for no stream). A stream behind its target asks for steps of
        ``catch_up_fraction`` of it while it catches up, never shorter (one that fell far behind
        must not hold every step at the floor)."""
        return min(
            (
                max(
                    self.params.safety * r.tpot_ms * r.num_output_tokens - (now - r.first_token_time) * 1e3,
                    self.params.catch_up_fraction * self.params.safety * r.tpot_ms,
                )
                for r in streams
                if r.tpot_ms is not None and r.first_token_time is not None
            ),
            default=math.inf,
        )

    def observe(self, report: StepReport) -> None:
        if report.num_tokens > 0:
            self.model.update(
                report.num_decodes, report.num_prefill_tokens, report.num_context_tokens, report.elapsed_ms
            )

    def _remember_ttft(self, requests: Sequence[SeqView]) -> None:
        for r in requests:
            if r.ttft_deadline is not None:
                ttft_ms = (r.ttft_deadline - r.arrival_time) * 1e3
                if self.strictest_ttft_ms is None or ttft_ms < self.strictest_ttft_ms:
                    self.strictest_ttft_ms = ttft_ms


def is_due(r: SeqView, now: float, late_too: bool = False) -> bool:
    """Whether ``r``'s first token is due: it has a TTFT deadline, not yet passed (past it, one long
    step would no longer save its SLO and would hold back the streams beside it; ``late_too`` when no
    stream runs, so a late prompt alone is not chunked for nobody), and no first token."""
    if r.first_token_time is not None or r.ttft_deadline is None:
        return False
    return late_too or r.ttft_deadline > now


def holding_back(
    request: SeqView, streams: Sequence[SeqView], shares: SlotShares, is_waiting: bool
) -> list[SeqView]:
    """The streams whose time in hand bounds ``request``'s first token: all but those of the tenants
    of its tier holding more of the tier's slots than its own tenant does (counting its own slot
    if it waits for one): a tenant ahead in slots does not delay, through its streams' TPOT, the
    first token of one behind it. With one tenant (or none named) that is every stream."""
    rank, tenant = request.tier_rank, request.tenant
    mine = shares.held.get(tenant, 0) + int(is_waiting)
    return [s for s in streams if s.tier_rank != rank or s.tenant == tenant or shares.held[s.tenant] <= mine]


def streams_decode_ms(cost: StepCost, streams: Sequence[SeqView]) -> float:
    """What the decodes of ``streams`` add to a step."""
    return sum(cost.decode_ms(r.num_tokens + 1) for r in streams)


def first_token_step_ms(
    cost: StepCost, decodes_ms: float, request: SeqView, max_tokens: int | None = None
) -> float:
    """The predicted step that carries the streams' decodes (``decodes_ms``) and the whole remaining
    prefill of ``request`` (at most ``max_tokens`` of it)."""
    remaining = max(1, request.num_tokens - request.num_computed_tokens)
    if max_tokens is not None:
        remaining = min(remaining, max_tokens)
    return cost.fixed_ms + decodes_ms + cost.chunk_ms(remaining, request.num_computed_tokens)
