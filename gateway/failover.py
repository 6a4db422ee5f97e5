"""Losing a worker: noticing it (the expiry sweep), and moving or ending the requests it was running.

Migration: a lost worker's requests are re-sent to a healthy worker of the same model as
``Submit(epoch + 1, resumed_token_ids = every token already queued for the client)``. The worker
treats those tokens as generated and sends only what follows, so the stream goes on with nothing lost
or repeated (exactly so for greedy sampling); the old worker's late deltas carry the old epoch and are
dropped (and answered with an Abort). After ``max_migrations`` moves, or with no healthy worker left,
the stream ends with WorkerLost (the client sees an error event), never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from gateway.in_flight import InFlightTable
from gateway.request_stream import InFlight, WorkerLost
from gateway.workers import RoutingError, WorkerRegistry
from wire.messages import Abort, GatewayMessage

__all__ = ["Failover"]

log = logging.getLogger(__name__)


class Failover:
    """Ejects silent or hung workers, and moves (or ends) the requests of every worker lost."""

    def __init__(
        self,
        registry: WorkerRegistry,
        in_flight: InFlightTable,
        *,
        place: Callable[[InFlight], bool],
        send: Callable[[str, GatewayMessage], bool],
        notify: Callable[[], None],
        heartbeat_timeout_s: float,
        hang_timeout_s: float,
        max_migrations: int,
    ) -> None:
        """``place`` sends a request to the best worker (False: none took it; RoutingError: the policy
        failed), ``send`` one message to a worker, ``notify`` tells waiters that workers changed."""
        self.registry = registry
        self.in_flight = in_flight
        self._place = place
        self._send = send
        self._notify = notify
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.max_migrations = max_migrations
        self.num_workers_lost = 0
        self.num_migrations: dict[str, int] = {}  # by model

    async def expire_loop(self) -> None:
        """Every quarter of the shorter timeout (so a worker is ejected at most 1.25x its timeout after
        it stops), lose the workers silent past ``heartbeat_timeout_s`` or hung past ``hang_timeout_s``."""
        interval_s = min(self.heartbeat_timeout_s, self.hang_timeout_s) / 4
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            silent = self.registry.expire(now, self.heartbeat_timeout_s)
            for worker in silent:
                lost = self.in_flight.detach(worker.worker_id)
                self.lose_worker(worker.worker_id, lost, f"no message for {self.heartbeat_timeout_s} s")
            hung = self.registry.expire_hung(now, self.hang_timeout_s)
            for worker in hung:
                lost = self.in_flight.detach(worker.worker_id)
                self.lose_worker(
                    worker.worker_id, lost, f"requests but no engine step for {self.hang_timeout_s} s"
                )
            if silent or hung:
                self._notify()

    def lose_worker(self, worker_id: str, request_ids: set[str], reason: str) -> None:
        """``worker_id`` is gone and ``request_ids`` were detached from it: abort each there (best
        effort) and move it elsewhere or end its stream. A migration may place one back on this worker
        (a new process that re-registered): the ids were detached first, so that one is not lost again."""
        self.num_workers_lost += 1
        log.warning("worker %s lost (%s); %d requests in flight", worker_id, reason, len(request_ids))
        for request_id in request_ids:
            request = self.in_flight.get(request_id)
            if request is not None and request.worker_id == worker_id:
                # Best effort: a worker that was only stalled frees the blocks when it wakes.
                self._send(worker_id, Abort(request_id=request_id, epoch=request.submit.epoch))
                self._fail_over(request, reason)

    def _fail_over(self, request: InFlight, reason: str) -> None:
        """Move ``request`` to another worker, or end its stream with WorkerLost when it may not move
        again or nowhere can take it."""
        lost_worker_id = request.worker_id
        self.in_flight.remove(request)
        why_not = self._migrate(request)
        if why_not is not None:
            log.warning("request %s not migrated: %s", request.request_id, why_not)
            request.queue.put_nowait(WorkerLost(lost_worker_id, request.request_id, f"{reason}; {why_not}"))

    def _migrate(self, request: InFlight) -> str | None:
        """Re-send ``request`` with ``epoch + 1``, resuming after the tokens already queued for its
        client; None once placed, else why it could not be."""
        if request.num_migrations >= self.max_migrations:
            return f"it already moved {request.num_migrations} times (gateway.max_migrations)"
        submit = request.submit
        if request.token_ids and len(request.token_ids) >= submit.sampling.max_tokens:
            # Its last token arrived without a finish (cannot happen with our workers): nothing to resume.
            # (A scored prompt with max_tokens 0 generates none: it runs again from its start.)
            return "every token it may generate was already sent"
        request.submit = msgspec.structs.replace(
            submit, epoch=submit.epoch + 1, resumed_token_ids=list(request.token_ids)
        )
        request.num_migrations += 1
        try:
            placed = self._place(request)
        except RoutingError:
            log.exception("routing failed migrating request %s", request.request_id)
            placed = False
        if not placed:
            return f"no healthy worker of model {request.model!r} to move it to"
        self.num_migrations[request.model] = self.num_migrations.get(request.model, 0) + 1
        log.info(
            "request %s migrated to worker %s (epoch %d, resuming after %d tokens)",
            request.request_id,
            request.worker_id,
            request.submit.epoch,
            len(request.token_ids),
        )
        return None
