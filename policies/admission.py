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
    """One arriving request and the state of its model's seats and queues."""

    tier: Tier
    seats: int  # what it asks for (its number of choices)
    seats_in_use: int
    capacity: int  # seats the ready workers offer now
    queue_length: int  # requests already waiting in this tier's queue
    seats_ahead: int  # seats waiting in this tier's queue and every more urgent one
    more_urgent_waiting: bool
    drain_rate: float | None  # seats released per second lately; None before the first release

    def expected_wait_s(self) -> float | None:
        """Seconds until this request would get its seats at the measured drain rate (0: at once)."""
        backlog = self.seats_in_use + self.seats_ahead + self.seats - max(self.capacity, self.seats)
        if backlog <= 0:
            return 0.0
        return None if not self.drain_rate else backlog / self.drain_rate


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    action: Action
    reason: str = ""  # for a shed: told to the client


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Decide for one arriving request.

    Invariants: "admit" only when ``seats_in_use + seats <= capacity`` (or nothing is in use: a request
    bigger than the fleet still runs alone) and nothing is waiting ahead of it (``seats_ahead == 0``),
    so a newcomer never overtakes a queued request of its tier or a more urgent one; "queue" only when
    the tier's queue has room (``queue_length < tier.max_queue``).
    """

    kind: ClassVar[str]

    def decide(self, view: AdmissionView) -> AdmissionDecision: ...


class BoundedQueueParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Per tier name: shed when the expected wait at the measured drain rate is longer than this
    # (a fast 429 instead of a request that would time out in the queue). Tiers not listed: no limit.
    max_wait_s: dict[str, Annotated[float, msgspec.Meta(gt=0)]] = msgspec.field(default_factory=dict)
    # Refuse a sheddable tier at once while a more urgent request waits.
    shed_while_urgent_waiting: bool = True


class BoundedQueue:
    """Admit while there are seats and nobody is ahead; otherwise queue in the tier's bounded queue;
    shed when it is full, when the expected wait passes the tier's ``max_wait_s``, or (sheddable tiers)
    while anything more urgent waits."""

    kind: ClassVar[str] = "admission"
    Params = BoundedQueueParams

    def __init__(self, params: BoundedQueueParams) -> None:
        self.params = params

    def decide(self, view: AdmissionView) -> AdmissionDecision:
        tier = view.tier
        fits = view.seats_in_use + view.seats <= view.capacity or view.seats_in_use == 0
        if fits and view.seats_ahead == 0:
            return AdmissionDecision("admit")
        if tier.sheddable and view.more_urgent_waiting and self.params.shed_while_urgent_waiting:
            return AdmissionDecision("shed", "overloaded: more urgent requests are waiting")
        if view.queue_length >= tier.max_queue:
            return AdmissionDecision("shed", f"the {tier.name!r} queue is full ({tier.max_queue} waiting)")
        limit = self.params.max_wait_s.get(tier.name)
        wait = view.expected_wait_s()
        if limit is not None and wait is not None and wait > limit:
            return AdmissionDecision(
                "shed",
                f"overloaded: the expected wait of {wait:.0f} s is past the {tier.name!r} tier's {limit:g} s",
            )
        return AdmissionDecision("queue")
