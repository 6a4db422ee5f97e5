"""Admission: seats, per-tier bounded queues in front of the workers, and 429 with a Retry-After.

    request ─▶ Admission(model).admit(tier, seats) ─▶ the admission policy decides (policies/admission.py)
                 ├─ admit ─▶ go now
                 ├─ queue ─▶ wait in the tier's queue (most urgent tier served first; within a tier by
                 │           the body's ``priority``, lower first, then arrival)
                 └─ shed ──▶ Shed: 429, Retry-After from the drain rate

This module is the mechanism; the built-in ``bounded-queue`` policy admits while the tier has room
and nobody is ahead, queues while the tier's queue has room, and sheds when it is full, when the
expected wait passes the tier's limit (sheddable tiers: 60 s by default), or (sheddable tiers) while
anything more urgent waits.

A *seat* is one sequence running or waiting on a worker. The fleet has ``capacity()`` of them (the ready
workers' ``max_num_seqs`` times ``gateway.max_in_flight_factor``: a little more than they run at once,
so each worker's own scheduler always has the next request at hand). A request with ``n`` choices takes
``n`` seats; it gets them all at once or waits. Seats are counted per tier, so a tier's room leaves out
the seats of less urgent tiers (up to twice the capacity in all: the worker's scheduler gives an urgent
request a less urgent one's slot) and keeps free what the more urgent tiers are predicted to need: 1.25
times the most each held over the last ``DEMAND_WINDOW_S``, less what it holds now. So a batch request
is deferred (then shed) before an interactive one would wait for a seat.

Retry-After is the time the queue ahead of the caller would take to drain at the rate seats were
released over the last ``DRAIN_WINDOW_S`` seconds (1 s when nothing has finished yet), clamped to
[1, ``MAX_RETRY_AFTER_S``]: a client that honours it comes back about when it could be served.

One event loop owns an Admission; nothing is locked.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from policies.admission import AdmissionPolicy, AdmissionView, BoundedQueue, BoundedQueueParams
from wire.tier import Tier

DRAIN_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60
DEMAND_WINDOW_S = 60.0  # a tier's peak seats over this long sizes what is kept free for it
RESERVE_HEADROOM = 1.25


class SlidingMax:
    """The largest value added in the last ``window_s`` (a monotonic deque: O(1) amortized)."""

    __slots__ = ("_values", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._values: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, value: int) -> None:
        while self._values and self._values[-1][1] <= value:
            self._values.pop()
        self._values.append((now, value))

    def peak(self, now: float) -> int:
        while self._values and now - self._values[0][0] > self.window_s:
            self._values.popleft()
        return self._values[0][1] if self._values else 0


class Shed(Exception):
    """The request was not admitted; answer 429 with ``retry_after_s``."""

    def __init__(self, tier: Tier, reason: str, retry_after_s: int) -> None:
        super().__init__(reason)
        self.tier = tier
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(slots=True, eq=False)
class _Waiter:
    tier: Tier
    seats: int
    priority: int
    enqueued_at: float
    granted: asyncio.Future[None]


@dataclass(slots=True, eq=False)
class Ticket:
    """Seats held by one admitted request; ``release`` (idempotent) gives them back."""

    admission: Admission
    tier: Tier
    seats: int
    waited_s: float  # time spent in the queue (0 when admitted at once)
    _released: bool = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.admission._release(self.tier, self.seats)


@dataclass(slots=True)
class TierCounts:
    admitted: int = 0
    queued: int = 0  # admitted after waiting
    shed: int = 0


class Admission:
    """The seats of one model's fleet and the per-tier queues for them."""

    def __init__(
        self,
        tiers: Iterable[Tier],
        capacity: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
        policy: AdmissionPolicy | None = None,
    ) -> None:
        self._tiers = sorted(tiers, key=lambda t: t.rank)
        self.policy: AdmissionPolicy = policy or BoundedQueue(BoundedQueueParams())
        self._capacity = capacity
        self._clock = clock
        self._queues: dict[str, collections.deque[_Waiter]] = {
            t.name: collections.deque() for t in self._tiers
        }
        self._in_use = 0
        self._in_use_by_tier = {t.name: 0 for t in self._tiers}
        self._demand = {t.name: SlidingMax(DEMAND_WINDOW_S) for t in self._tiers}
        self._released: collections.deque[tuple[float, int]] = collections.deque()  # (time, seats)
        self.counts: dict[str, TierCounts] = {t.name: TierCounts() for t in self._tiers}

    # ---- what metrics and tests read ----------------------------------------------------------

    @property
    def seats_in_use(self) -> int:
        return self._in_use

    def queue_length(self, tier_name: str) -> int:
        return len(self._queues[tier_name])

    def drain_rate(self) -> float | None:
        """Seats released per second over the last ``DRAIN_WINDOW_S``; None before the first release."""
        now = self._clock()
        self._forget_old_releases(now)
        if not self._released:
            return None
        span = max(now - self._released[0][0], 1.0)
        return sum(seats for _, seats in self._released) / span

    # ---- admitting ----------------------------------------------------------------------------

    async def admit(self, tier: Tier, seats: int = 1, priority: int = 0) -> Ticket:
        """Seats for one request: at once, after waiting in ``tier``'s queue, or :class:`Shed`.

        In the queue a request goes behind every waiter of its tier whose ``priority`` is not larger.
        Cancelling the caller while it waits (the client went away) leaves the queue cleanly.
        """
        if tier.name not in self._queues:
            raise KeyError(f"unknown tier {tier.name!r}")
        now = self._clock()
        decision = self.policy.decide(self.view(tier, seats, priority))
        if decision.action == "admit":
            self._take(tier, seats)
            self.counts[tier.name].admitted += 1
            return Ticket(self, tier, seats, 0.0)
        if decision.action == "shed":
            raise self._shed(tier, decision.reason or "overloaded")
        queue = self._queues[tier.name]
        waiter = _Waiter(tier, seats, priority, now, asyncio.get_running_loop().create_future())
        queue.insert(self._position(queue, priority), waiter)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release(tier, seats)  # granted in the same instant we were cancelled: give them back
            else:
                with contextlib.suppress(ValueError):  # _grant may have dropped it already
                    queue.remove(waiter)
                self._grant()  # a head that was too big may have blocked smaller ones behind it
            raise
        self.counts[tier.name].admitted += 1
        self.counts[tier.name].queued += 1
        return Ticket(self, tier, seats, self._clock() - now)

    @staticmethod
    def _position(queue: collections.deque[_Waiter], priority: int) -> int:
        """Where a waiter of ``priority`` joins its tier's queue: behind every one not larger."""
        for i, waiter in enumerate(queue):
            if waiter.priority > priority:
                return i
        return len(queue)

    def view(self, tier: Tier, seats: int, priority: int = 0) -> AdmissionView:
        """What the admission policy decides on for a request of ``tier`` asking for ``seats``."""
        queue = self._queues[tier.name]
        return self._view(tier, seats, sum(w.seats for w in queue if w.priority <= priority))

    def _view(self, tier: Tier, seats: int, seats_ahead_in_tier: int) -> AdmissionView:
        more_urgent = [t for t in self._tiers if t.rank < tier.rank]
        return AdmissionView(
            tier=tier,
            seats=seats,
            seats_in_use=self._in_use,
            capacity=self._capacity(),
            queue_length=len(self._queues[tier.name]),
            seats_ahead=sum(w.seats for t in more_urgent for w in self._queues[t.name]) + seats_ahead_in_tier,
            more_urgent_waiting=any(self._queues[t.name] for t in more_urgent),
            drain_rate=self.drain_rate(),
            seats_in_use_at_or_above=sum(self._in_use_by_tier[t.name] for t in (*more_urgent, tier)),
            seats_reserved=sum(self._reserve(t) for t in more_urgent),
        )

    def _reserve(self, tier: Tier) -> int:
        """Free seats kept for ``tier``: what its peak over ``DEMAND_WINDOW_S`` (with headroom) needs
        beyond what it holds now. (A tier never seen lately gets none kept: an arrival of it is
        still admitted at once, into the overflow, when it is more urgent than what runs.)"""
        in_use = self._in_use_by_tier[tier.name]
        peak = max(self._demand[tier.name].peak(self._clock()), in_use)
        return max(0, math.ceil(RESERVE_HEADROOM * peak) - in_use)

    def _take(self, tier: Tier, seats: int) -> None:
        self._in_use += seats
        self._in_use_by_tier[tier.name] += seats
        self._demand[tier.name].add(self._clock(), self._in_use_by_tier[tier.name])

    def _shed(self, tier: Tier, reason: str) -> Shed:
        self.counts[tier.name].shed += 1
        return Shed(tier, reason, self.retry_after_s(tier))

    def retry_after_s(self, tier: Tier) -> int:
        ahead = sum(w.seats for t in self._tiers if t.rank <= tier.rank for w in self._queues[t.name]) + 1
        rate = self.drain_rate() or 1.0
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(ahead / rate)))

    # ---- releasing ----------------------------------------------------------------------------

    def _release(self, tier: Tier, seats: int) -> None:
        self._in_use -= seats
        self._in_use_by_tier[tier.name] -= seats
        now = self._clock()
        self._released.append((now, seats))
        self._forget_old_releases(now)
        self._grant()

    def capacity_changed(self) -> None:
        """Workers joined: waiting requests may fit now."""
        self._grant()

    def _grant(self) -> None:
        """Hand free seats to waiters: most urgent tier first, in queue order within it, never
        skipping a head; a head goes when the policy would admit it (nobody ahead of it)."""
        for tier in self._tiers:
            queue = self._queues[tier.name]
            while queue:
                head = queue[0]
                if head.granted.done():  # cancelled; its admit() removes it
                    queue.popleft()
                    continue
                if self.policy.decide(self._view(tier, head.seats, 0)).action != "admit":
                    return
                queue.popleft()
                self._take(tier, head.seats)
                head.granted.set_result(None)

    def _forget_old_releases(self, now: float) -> None:
        while self._released and now - self._released[0][0] > DRAIN_WINDOW_S:
            self._released.popleft()


@dataclass(slots=True)
class AdmissionBook:
    """One :class:`Admission` per served model, created on first use, all deciding with ``policy``."""

    tiers: tuple[Tier, ...]
    capacity_of: Callable[[str], int]
    policy: AdmissionPolicy | None = None
    by_model: dict[str, Admission] = field(default_factory=dict)

    def __call__(self, model: str) -> Admission:
        admission = self.by_model.get(model)
        if admission is None:
            admission = self.by_model[model] = Admission(
                self.tiers, lambda: self.capacity_of(model), policy=self.policy
            )
        return admission

    def capacity_changed(self) -> None:
        for admission in self.by_model.values():
            admission.capacity_changed()
