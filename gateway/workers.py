"""The worker registry: who is connected, what each serves, how loaded it is, and what it is running.

Pure bookkeeping, no sockets and no clock of its own: the dispatcher feeds it the messages workers send
(Register, Heartbeat, DrainNotice) with the arrival time, and asks it whom to send the next request to.

    Register ──▶ READY ──DrainNotice──▶ DRAINING
                   │                        │
                   └──── no message for timeout_s (expire) ──▶ DEAD ──Register/Heartbeat──▶ READY

Liveness is judged by arrival on the gateway's monotonic clock, never by ``Heartbeat.sent_at``
(wall clocks do not compare across hosts).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from wire.messages import DrainNotice, Heartbeat, Register, WorkerStats


class WorkerState(enum.Enum):
    READY = "ready"
    DRAINING = "draining"  # finishing what it has, taking nothing new
    DEAD = "dead"  # stopped talking; its in-flight requests have been failed (or, later, migrated)


@dataclass(slots=True)
class WorkerInfo:
    """One worker as this gateway knows it. ``in_flight_ids`` are the requests *this* gateway sent it."""

    worker_id: str
    register: Register
    last_seen: float  # monotonic arrival time of the last message of any kind
    state: WorkerState = WorkerState.READY
    stats: WorkerStats | None = None  # from the last heartbeat; None until the first one
    heartbeat_seq: int | None = None
    in_flight_ids: set[str] = field(default_factory=set)

    @property
    def model(self) -> str:
        return self.register.model

    @property
    def num_load(self) -> int:
        """Requests on the worker: the larger of what it last reported and what we have sent it.

        The report lags (it is as old as the last heartbeat), so a burst of submits between two
        heartbeats would otherwise all land on whichever worker looked idle; our own count is current
        but blind to other gateways sharing the worker. The larger of the two is right in both cases.
        """
        reported = self.stats.num_running + self.stats.num_waiting if self.stats is not None else 0
        return max(reported, len(self.in_flight_ids))

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use at the last heartbeat (0 before the first)."""
        stats = self.stats
        if stats is None or stats.num_total_blocks <= 0:
            return 0.0
        return 1.0 - stats.num_free_blocks / stats.num_total_blocks


class WorkerRegistry:
    """Every worker that ever registered (dead ones stay, so /metrics and a re-Register can see them)."""

    __slots__ = ("_next_tie", "_workers")

    def __init__(self) -> None:
        self._workers: dict[str, WorkerInfo] = {}
        self._next_tie = 0  # rotates through tied candidates so equal load spreads

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[WorkerInfo]:
        return iter(list(self._workers.values()))

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def on_register(self, message: Register, now: float) -> set[str]:
        """Add a worker, or replace a known one's info; returns the request ids it has lost.

        A Register with a new pid is a new process: whatever the old one was running is gone. The same
        pid is a reconnect (the network blinked, or the gateway dropped the link): it still runs its
        requests and will keep sending their tokens, so they stay in flight.
        """
        info = self._workers.get(message.worker_id)
        if info is None:
            self._workers[message.worker_id] = WorkerInfo(message.worker_id, message, now)
            return set()
        lost: set[str] = set()
        if info.register.pid != message.pid:
            lost, info.in_flight_ids = info.in_flight_ids, set()
            info.stats = None
            info.heartbeat_seq = None
        info.register = message
        info.last_seen = now
        info.state = WorkerState.READY
        return lost

    def on_heartbeat(self, message: Heartbeat, now: float) -> WorkerInfo | None:
        """Record load and liveness; None for a worker that never registered (its heartbeat is ignored)."""
        info = self._workers.get(message.worker_id)
        if info is None:
            return None
        info.stats = message.stats
        info.heartbeat_seq = message.seq
        info.last_seen = now
        if info.state is WorkerState.DEAD:
            # We gave up on it too early (it was stalled, not gone): its old requests are already
            # failed, but it can take new ones.
            info.state = WorkerState.READY
        return info

    def on_drain(self, message: DrainNotice, now: float) -> WorkerInfo | None:
        info = self._workers.get(message.worker_id)
        if info is None:
            return None
        info.last_seen = now
        if info.state is not WorkerState.DEAD:
            info.state = WorkerState.DRAINING
        return info

    def touch(self, worker_id: str, now: float) -> WorkerInfo | None:
        """Any message proves a worker alive (a busy one's tokens arrive between its heartbeats)."""
        info = self._workers.get(worker_id)
        if info is not None and info.state is not WorkerState.DEAD:
            info.last_seen = now
        return info

    def pick(self, model: str, *, exclude: Collection[str] = ()) -> WorkerInfo | None:
        """The least-loaded ready worker serving ``model``: fewest requests, then least KV in use;
        exact ties rotate, so idle workers share a burst instead of the first one taking it all."""
        best: list[WorkerInfo] = []
        best_key: tuple[int, float] | None = None
        for info in self._workers.values():
            if info.state is not WorkerState.READY or info.model != model or info.worker_id in exclude:
                continue
            key = (info.num_load, info.kv_usage)
            if best_key is None or key < best_key:
                best, best_key = [info], key
            elif key == best_key:
                best.append(info)
        if not best:
            return None
        chosen = best[self._next_tie % len(best)]
        self._next_tie += 1
        return chosen

    def expire(self, now: float, timeout_s: float) -> list[WorkerInfo]:
        """Mark workers silent for longer than ``timeout_s`` dead; returns the newly dead ones, their
        ``in_flight_ids`` intact for the caller to fail or migrate (and then clear)."""
        newly_dead = []
        for info in self._workers.values():
            if info.state is not WorkerState.DEAD and now - info.last_seen > timeout_s:
                info.state = WorkerState.DEAD
                newly_dead.append(info)
        return newly_dead

    def num_in_state(self, state: WorkerState, model: str | None = None) -> int:
        return sum(1 for w in self._workers.values() if w.state is state and model in (None, w.model))
