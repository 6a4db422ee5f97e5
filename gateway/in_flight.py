"""The requests this gateway has in flight, and the worker each was sent to: one table owns both.

    InFlightTable ── get(request_id) ───────────▶ the InFlight record (tokens, queue, epoch)
                  ── request_ids_on(worker_id) ─▶ its ids on one worker (a live, read-only view:
                                                  WorkerInfo.in_flight_ids, routing's num_in_flight)

Only :meth:`~InFlightTable.add`, :meth:`~InFlightTable.remove` and :meth:`~InFlightTable.detach` change
who runs what (``add`` also sets ``InFlight.worker_id``), so the records, the per-worker sets and the
stats cannot drift apart.
A worker found gone is :meth:`~InFlightTable.detach`-ed: its requests stay here, on no worker, until
failover (gateway/failover.py) moves or ends each one.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Set as AbstractSet

from gateway.request_stream import InFlight

__all__ = ["InFlightTable"]


class InFlightTable:
    """Every request in flight here (request id → :class:`InFlight`), indexed by the worker running it."""

    __slots__ = ("_ids_by_worker", "_requests")

    def __init__(self) -> None:
        self._requests: dict[str, InFlight] = {}
        # One set per worker id, made on first use and never replaced, so views of it stay live.
        self._ids_by_worker: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __iter__(self) -> Iterator[InFlight]:
        """A snapshot: the caller may add and remove while it iterates."""
        return iter(list(self._requests.values()))

    def get(self, request_id: str) -> InFlight | None:
        return self._requests.get(request_id)

    def request_ids_on(self, worker_id: str) -> AbstractSet[str]:
        """The ids of the requests on ``worker_id``: a live view (it follows every add and remove)."""
        return self._worker_ids(worker_id)

    def add(self, request: InFlight, worker_id: str) -> None:
        """Track ``request`` (not in flight yet) as running on ``worker_id``."""
        request.worker_id = worker_id
        self._requests[request.request_id] = request
        self._worker_ids(worker_id).add(request.request_id)

    def remove(self, request: InFlight) -> bool:
        """Stop tracking ``request``; False, changing nothing, when that record is not in flight."""
        if self._requests.get(request.request_id) is not request:
            return False
        del self._requests[request.request_id]
        self._worker_ids(request.worker_id).discard(request.request_id)
        return True

    def detach(self, worker_id: str) -> set[str]:
        """``worker_id`` is gone: returns the ids of its requests, now on no worker. Their records stay
        (``get``, ``InFlight.worker_id`` naming the lost worker) until the caller re-adds or removes each."""
        ids = self._worker_ids(worker_id)
        lost = set(ids)
        ids.clear()
        return lost

    def _worker_ids(self, worker_id: str) -> set[str]:
        ids = self._ids_by_worker.get(worker_id)
        if ids is None:
            ids = self._ids_by_worker[worker_id] = set()
        return ids
