"""Admission at the gateway: admit a request now, queue it, or shed it (429 with Retry-After).

The gateway owns the mechanism (seats, one FIFO queue per tier served most urgent first, the measured
drain rate, Retry-After; gateway/admission.py); a policy only decides, from an :class:`AdmissionView`,
what happens to one arriving request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Protocol, runtime_checkable

import msgspec

from wire.tier import Tier

Action = Literal["admit", "queue", "shed"]


@dataclass(frozen=True, slots=True)
class AdmissionView:
    """One arriving request and the state of its model's seats and queues.

    ``seats_reserved``: free seats the mechanism keeps for the tiers more urgent than this one (from
    their measured peak demand; 0 for the most urgent tier). ``seats_in_use_at_or_above``: seats held
    by this tier and the more urgent ones (what a request can never take a slot from on a worker).
    """

    tier: Tier
    seats: int  # what it asks for (its number of choices)
    seats_in_use: int
    capacity: int  # seats the ready workers offer now
    queue_length: int  # requests already waiting in this tier's queue
    seats_ahead: int  # seats waiting in this tier's queue (priority not larger) and every more urgent one
    more_urgent_waiting: bool
    drain_rate: float | None  # seats released per second lately; None before the first release
    seats_in_use_at_or_above: int | None = None  # None: as seats_in_use
    seats_reserved: int = 0

    @property
    def room(self) -> int:
        """Seats this tier may fill before it waits: the capacity less what is kept for more urgent
        tiers (never below one seat: something always runs)."""
        return max(1, self.capacity - self.seats_reserved)

    def expected_wait_s(self) -> float | None:
        """Seconds until this request would get its seats at the measured drain rate (0: at once)."""
        backlog = self.seats_in_use + self.seats_ahead + self.seats - max(self.room, self.seats)
        if backlog <= 0:
            return 0.0
        return None if not self.drain_rate else backlog / self.drain_rate


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    action: Action
    reason: str = ""  # for a shed: told to the client


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Decide for one arriving request (and, for the head of a tier's queue, whether it may go now).

    Invariants: "admit" only when nothing is waiting ahead of it (``seats_ahead == 0``), so a
    newcomer never overtakes a queued request of its tier or a more urgent one, and only within
    ``2 · capacity`` seats in use (or when nothing is in use: a request bigger than the fleet still
    runs alone); "queue" only when the tier's queue has room (``queue_length < tier.max_queue``).
    """

    kind: ClassVar[str]

    def decide(self, view: AdmissionView) -> AdmissionDecision: ...


class BoundedQueueParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Per tier name: shed when the expected wait at the measured drain rate is longer than this
    # (a fast 429 instead of a request that would time out in the queue). Tiers not listed: no
    # limit, except sheddable ones, which get ``sheddable_max_wait_s``.
    max_wait_s: dict[str, Annotated[float, msgspec.Meta(gt=0)]] = msgspec.field(default_factory=dict)
    sheddable_max_wait_s: Annotated[float, msgspec.Meta(gt=0)] | None = 60.0
    # Refuse a sheddable tier at once while a more urgent request waits.
    shed_while_urgent_waiting: bool = True
    # A tier may be admitted past the fleet's seats, by up to this fraction of them, into seats held
    # by less urgent tiers: the worker's scheduler takes their slots for it (they wait, keeping
    # their cached prefix). 0: never past the capacity.
    max_overflow: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0


class BoundedQueue:
    """Admit while the tier has room and nobody is ahead; otherwise queue in the tier's bounded
    queue; shed when it is full, when the expected wait passes the tier's limit, or (sheddable
    tiers) while anything more urgent waits.

    A tier's room: the seats held by it and the more urgent tiers must leave the seats reserved for
    those more urgent ones, and the total stays within ``(1 + max_overflow) · capacity``. So the
    most urgent tier is admitted whenever its own load allows (batch work only delays it by a
    preempted slot on the worker), and a less urgent one is deferred, then shed, before it would
    take a seat an urgent arrival is predicted to need.
    """

    kind: ClassVar[str] = "admission"
    Params = BoundedQueueParams

    def __init__(self, params: BoundedQueueParams) -> None:
        self.params = params

    def fits(self, view: AdmissionView) -> bool:
        if view.seats_in_use == 0:
            return True
        at_or_above = (
            view.seats_in_use if view.seats_in_use_at_or_above is None else view.seats_in_use_at_or_above
        )
        ceiling = view.capacity + int(self.params.max_overflow * view.capacity)
        return at_or_above + view.seats <= view.room and view.seats_in_use + view.seats <= ceiling

    def decide(self, view: AdmissionView) -> AdmissionDecision:
        tier = view.tier
        if self.fits(view) and view.seats_ahead == 0:
            return AdmissionDecision("admit")
        if tier.sheddable and view.more_urgent_waiting and self.params.shed_while_urgent_waiting:
            return AdmissionDecision("shed", "overloaded: more urgent requests are waiting")
        if view.queue_length >= tier.max_queue:
            return AdmissionDecision("shed", f"the {tier.name!r} queue is full ({tier.max_queue} waiting)")
        limit = self.params.max_wait_s.get(tier.name)
        if limit is None and tier.sheddable:
            limit = self.params.sheddable_max_wait_s
        wait = view.expected_wait_s()
        if limit is not None and wait is not None and wait > limit:
            return AdmissionDecision(
                "shed",
                f"overloaded: the expected wait of {wait:.0f} s is past the {tier.name!r} tier's {limit:g} s",
            )
        return AdmissionDecision("queue")
