"""Worker → gateway: each frame decoded, its sender checked, then handed to the one handler for its type.

    ROUTER frame [identity, msgpack] ── decode ── TokenBatch ── deltas → per-request queues (by epoch)
                                               ├─ Rejected ── re-placed (503) or the stream's error
                                               ├─ Register / Heartbeat / DrainNotice → registry
                                               └─ KVEvents / KVSnapshot → the worker's prefix index

Trust: a frame is only believed from the connection it claims to come from (the ROUTER identity must be
the worker id it names, and a delta must come from the worker its request was sent to, with the current
epoch); anything else is counted and dropped. Token batches and KV events come every engine step and
wake nobody; the other messages, and every drop (a counter changed), notify.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeAlias

from gateway.failover import Failover
from gateway.in_flight import InFlightTable
from gateway.request_stream import InFlight, WorkerRejected
from gateway.workers import RoutingError, WorkerInfo, WorkerRegistry
from wire.codec import worker_message_decoder
from wire.log_every import is_logged
from wire.messages import (
    Abort,
    DrainNotice,
    GatewayMessage,
    Heartbeat,
    KVEvents,
    KVSnapshot,
    Register,
    Rejected,
    ResyncKV,
    TokenBatch,
    TokenDelta,
)

__all__ = ["WorkerMessages"]

log = logging.getLogger(__name__)
LOG_EVERY = 1000  # frames from unknown peers: the first logged, then every Nth

# The worker messages that name their sender (all but Rejected, which is checked against its request).
_Named: TypeAlias = Register | TokenBatch | Heartbeat | DrainNotice | KVEvents | KVSnapshot


class WorkerMessages:
    """The gateway's side of every worker message; owns the counters of what it dropped."""

    def __init__(
        self,
        registry: WorkerRegistry,
        in_flight: InFlightTable,
        failover: Failover,
        *,
        place: Callable[[InFlight, set[str]], bool],
        send: Callable[[str, GatewayMessage], bool],
        notify: Callable[[], None],
    ) -> None:
        """``place`` re-sends a request to the best worker not in the set (the dispatcher's),
        ``send`` one message to a worker, ``notify`` tells waiters that workers or counters changed."""
        self._registry = registry
        self._in_flight = in_flight
        self._failover = failover
        self._place = place
        self._send = send
        self._notify = notify
        self.decoder = worker_message_decoder()
        # Found by exact type (a TokenBatch comes every step).
        self.handlers: dict[type, Callable[[bytes, Any, float], None]] = {
            TokenBatch: self._on_token_batch,
            Rejected: self._on_rejected,
            KVEvents: self._on_kv_events,
            KVSnapshot: self._on_kv_snapshot,
            Heartbeat: self._on_heartbeat,
            DrainNotice: self._on_drain,
            Register: self._on_register,
        }
        self.num_dropped_multipart = 0  # not the [identity, frame] shape a worker sends
        self.num_dropped_unknown_peer = 0  # well-formed, but not from the worker it names, or unregistered
        self.num_stale_deltas = 0  # for a request no longer in flight here, an old epoch, or another worker

    def on_frames(self, parts: list[bytes], now: float) -> None:
        """One ROUTER message (``now``: monotonic, when it arrived)."""
        if len(parts) != 2:
            self.num_dropped_multipart += 1
            self._notify()
            return
        identity, frame = parts
        message = self.decoder.decode(frame)
        if message is None:
            self._notify()
            return
        self.handlers[type(message)](identity, message, now)

    def _on_token_batch(self, identity: bytes, batch: TokenBatch, now: float) -> None:
        if self._sender(identity, batch, now) is not None:
            for delta in batch.deltas:
                self._on_delta(batch.worker_id, delta)

    def _on_delta(self, worker_id: str, delta: TokenDelta) -> None:
        request = self._in_flight.get(delta.request_id)
        if request is None or request.submit.epoch != delta.epoch or request.worker_id != worker_id:
            self.num_stale_deltas += 1  # aborted, migrated, or finished: nobody waits for it
            if delta.finish_reason is None:
                # Still running there (an ejected worker that woke up, or our Abort was lost with the
                # link): stop it. The epoch keeps this from touching a newer attempt on that worker.
                self._send(worker_id, Abort(request_id=delta.request_id, epoch=delta.epoch))
            return
        request.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            self._in_flight.remove(request)
        request.queue.put_nowait(delta)

    def _on_rejected(self, identity: bytes, message: Rejected, now: float) -> None:
        # It names no worker: it must come from the one its request (at its epoch) was sent to.
        request = self._in_flight.get(message.request_id)
        if request is None or request.submit.epoch != message.epoch or request.worker_id.encode() != identity:
            self.num_stale_deltas += 1
            return
        self._registry.touch(request.worker_id, now)
        self._in_flight.remove(request)
        # 503: the worker began draining after we picked it. It ran nothing, so the same Submit (same
        # epoch) can go to another worker; the client never learns.
        if message.status == 503:
            try:
                if self._place(request, {request.worker_id}):
                    return
            except RoutingError:
                log.exception("routing failed re-placing request %s", request.request_id)
        request.queue.put_nowait(WorkerRejected(message.status, message.field, message.message))

    def _on_kv_events(self, identity: bytes, events: KVEvents, now: float) -> None:
        if (worker := self._sender(identity, events, now)) is not None:
            worker.prefix.on_events(events)
            self._resync_if_stale(worker, now)

    def _on_kv_snapshot(self, identity: bytes, snapshot: KVSnapshot, now: float) -> None:
        if (worker := self._sender(identity, snapshot, now)) is not None:
            worker.prefix.on_snapshot(snapshot)
            self._resync_if_stale(worker, now)

    def _on_heartbeat(self, identity: bytes, heartbeat: Heartbeat, now: float) -> None:
        if not self._is_from(identity, heartbeat):
            return
        worker = self._registry.on_heartbeat(heartbeat, now)
        if worker is None:
            self._drop_unknown_peer(identity, "Heartbeat")
            return
        worker.prefix.on_heartbeat(heartbeat.stats.kv_events_seq)
        self._resync_if_stale(worker, now)
        self._notify()

    def _on_drain(self, identity: bytes, notice: DrainNotice, now: float) -> None:
        if not self._is_from(identity, notice):
            return
        if self._registry.on_drain(notice, now) is None:
            self._drop_unknown_peer(identity, "DrainNotice")
            return
        log.info("worker %s draining: %s", notice.worker_id, notice.reason)
        self._notify()

    def _on_register(self, identity: bytes, message: Register, now: float) -> None:
        if not self._is_from(identity, message):
            return
        known = self._registry.get(message.worker_id)
        previous_pid = known.register.pid if known is not None else None
        lost = self._registry.on_register(message, now)
        log.info(
            "worker %s registered: model %s, pid %d (before: %s), %d KV blocks, context %d, on %s (%s) in %s",
            message.worker_id,
            message.model,
            message.pid,
            previous_pid,
            message.num_kv_blocks,
            message.max_model_len,
            message.device,
            message.device_name or "?",
            message.dtype,
        )
        worker = self._registry.get(message.worker_id)
        assert worker is not None
        self._resync_if_stale(worker, now)  # a new index, for a new process or a new link
        if lost:
            self._failover.lose_worker(
                worker.worker_id, lost, f"restarted (pid {previous_pid} → {message.pid})"
            )
        self._notify()

    def _resync_if_stale(self, worker: WorkerInfo, now: float) -> None:
        """Ask for a KVSnapshot when the worker's prefix index can no longer be trusted."""
        if worker.prefix.wants_resync(now):
            log.debug("asking worker %s for its prefix cache (resync %d)", worker.worker_id,
                      worker.prefix.num_resyncs)  # fmt: skip
            self._send(worker.worker_id, ResyncKV())

    def _is_from(self, identity: bytes, message: _Named) -> bool:
        """Whether the frame came over the link of the worker it names (if not: counted and dropped)."""
        if message.worker_id.encode() == identity:
            return True
        self._drop_unknown_peer(identity, type(message).__name__)
        return False

    def _sender(self, identity: bytes, message: _Named, now: float) -> WorkerInfo | None:
        """The registered worker that sent ``message``, its liveness refreshed; None (counted and
        dropped) when the frame is not from the worker it names, or that worker never registered."""
        if not self._is_from(identity, message):
            return None
        worker = self._registry.touch(message.worker_id, now)
        if worker is None:
            self._drop_unknown_peer(identity, type(message).__name__)
        return worker

    def _drop_unknown_peer(self, identity: bytes, what: str) -> None:
        self.num_dropped_unknown_peer += 1
        if is_logged(self.num_dropped_unknown_peer, LOG_EVERY):
            log.warning(
                "dropped a %s from peer %r: not a registered worker of that id (%d such drops)",
                what,
                identity[:64],
                self.num_dropped_unknown_peer,
            )
        self._notify()
