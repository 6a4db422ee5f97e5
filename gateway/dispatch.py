"""The gateway's one ZeroMQ ROUTER: Submit/Abort out, worker messages in, tokens demultiplexed per request.

    submit() ── pick (routing policy) ── Submit ──▶ ROUTER ══▶ worker DEALERs (identity = worker_id)
    RequestStream ◀── asyncio.Queue per request ◀── receive task ◀── TokenBatch / Rejected
                                     registry ◀── receive task ◀── Register / Heartbeat / DrainNotice
          migrate, or WorkerLost ◀── expiry task (no message for heartbeat_timeout_s, or requests
                                     but no engine step for hang_timeout_s), or a new pid registers

The pieces: the socket (gateway/worker_socket.py: sends never wait, so a cancelled consumer can send
its Abort from inside its cancellation); the in-flight table (gateway/in_flight.py), the one record of
which request runs on which worker, which the registry reads too; and failover (gateway/failover.py):
a lost worker's requests move to another worker with ``epoch + 1``, resuming after what the client
has, or end with WorkerLost. Everything runs on one event loop, so nothing here is locked.

Trust: a frame is only believed from the connection it claims to come from (the ROUTER identity must be
the worker id it names, and a delta must come from the worker its request was sent to, with the current
epoch); anything else is counted and dropped. Links are authenticated only with CURVE (the socket's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import zmq

from gateway.failover import Failover
from gateway.in_flight import InFlightTable
from gateway.link_security import CurveServerKeys
from gateway.request_stream import (
    DispatcherClosed,
    DispatchError,
    InFlight,
    NoWorkerAvailable,
    RequestStream,
    WorkerLost,
    WorkerRejected,
)
from gateway.worker_socket import WorkerSocket
from gateway.workers import PromptKey, RoutingError, WorkerInfo, WorkerRegistry, WorkerState
from policies.routing import RouteRequest, RoutingPolicy
from wire.codec import DecodeStats, encode, worker_message_decoder
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
    Submit,
    TokenBatch,
    TokenDelta,
)
from wire.sampling import SamplingParams
from wire.tier import Tier

__all__ = [
    "DispatchError",
    "DispatchStats",
    "Dispatcher",
    "DispatcherClosed",
    "NoWorkerAvailable",
    "RequestStream",
    "WorkerLost",
    "WorkerRejected",
]

log = logging.getLogger(__name__)
LOG_EVERY = 1000  # frames from unknown peers: the first logged, then every Nth

# The worker messages that name their sender (all but Rejected, which is checked against its request).
_Named: TypeAlias = Register | TokenBatch | Heartbeat | DrainNotice | KVEvents | KVSnapshot


@dataclass(slots=True, frozen=True)
class DispatchStats:
    num_workers_ready: int
    num_workers_draining: int
    num_workers_dead: int
    num_in_flight: int
    decode: DecodeStats  # frames that were not a valid message
    num_dropped_multipart: int  # not the [identity, frame] shape a worker sends
    num_dropped_unknown_peer: int  # well-formed, but not from the worker it names, or never registered
    num_stale_deltas: int  # for a request no longer in flight here, an old epoch, or another worker
    num_send_failures: int
    num_workers_lost: int
    num_migrations: Mapping[str, int]  # by model: requests moved to another worker after losing one


class Dispatcher:
    """Owns the ROUTER socket, the worker registry, the in-flight table and the failover of this gateway."""

    def __init__(
        self,
        bind: str,
        *,
        heartbeat_timeout_s: float = 3.0,
        hang_timeout_s: float = 30.0,
        max_migrations: int = 2,
        routing: RoutingPolicy | None = None,
        curve: CurveServerKeys | None = None,
    ) -> None:
        """``routing``: the policy that picks a worker per request (least-loaded when not given).
        ``curve``: the ROUTER is a CURVE server letting in only the listed workers' keys (plain when
        None). The other three are ``gateway.heartbeat_timeout_s``, ``hang_timeout_s`` and
        ``max_migrations``."""
        self._in_flight = InFlightTable()  # the one record of which request runs where
        self.registry = WorkerRegistry(routing, self._in_flight)
        self._failover = Failover(
            self.registry,
            self._in_flight,
            place=self._place,
            send=self._send,
            notify=self._notify,
            heartbeat_timeout_s=heartbeat_timeout_s,
            hang_timeout_s=hang_timeout_s,
            max_migrations=max_migrations,
        )
        self._socket = WorkerSocket(bind, curve)
        self.address = self._socket.address  # tcp://127.0.0.1:0 bound an ephemeral port: this is it
        self._decoder = worker_message_decoder()
        # One handler per worker message type, found by exact type (a TokenBatch comes every step).
        self._handlers: dict[type, Callable[[bytes, Any, float], None]] = {
            TokenBatch: self._on_token_batch,
            Rejected: self._on_rejected,
            KVEvents: self._on_kv_events,
            KVSnapshot: self._on_kv_snapshot,
            Heartbeat: self._on_heartbeat,
            DrainNotice: self._on_drain,
            Register: self._on_register,
        }
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()  # set and replaced whenever the registry or counters change
        self._listeners: list[Callable[[], None]] = []
        self._is_closed = False
        self._num_dropped_multipart = 0
        self._num_dropped_unknown_peer = 0
        self._num_stale_deltas = 0

    # ---- lifecycle and watching ---------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="dispatch-receive"),
            asyncio.create_task(self._failover.expire_loop(), name="dispatch-expire"),
        ]
        if self._socket.curve is not None:
            self._tasks.append(asyncio.create_task(self._socket.curve.watch(), name="dispatch-curve"))

    async def close(self) -> None:
        """Abort every in-flight request (their streams end with DispatcherClosed) and free the socket."""
        if self._is_closed:
            return
        self._is_closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.end_in_flight("the gateway's dispatcher is shutting down")
        self._socket.close()

    def end_in_flight(self, why: str) -> None:
        """Abort every in-flight request on its worker and end its stream with DispatcherClosed(why);
        the links stay up (a stop that wants the streams' connections closed before the workers go)."""
        for request in self._in_flight:
            self._abort(request)
            request.queue.put_nowait(DispatcherClosed(why))

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Return once ``predicate()`` holds, re-checked after every worker message but token batches;
        ``TimeoutError`` at the deadline."""
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await self._changed.wait()

    async def wait_for_workers(self, model: str, n: int, timeout_s: float) -> None:
        """Start-up: wait until ``n`` workers of ``model`` are ready; TimeoutError says how many are."""

        def num_ready() -> int:
            return self.registry.num_in_state(WorkerState.READY, model)

        try:
            await self.wait_until(lambda: num_ready() >= n, timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"{num_ready()} of {n} workers of model {model!r} ready after {timeout_s} s"
            ) from None

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the loop, not awaited) whenever the registry may have changed."""
        self._listeners.append(callback)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        for callback in self._listeners:
            callback()

    def stats(self) -> DispatchStats:
        count = self.registry.num_in_state
        return DispatchStats(
            num_workers_ready=count(WorkerState.READY),
            num_workers_draining=count(WorkerState.DRAINING),
            num_workers_dead=count(WorkerState.DEAD),
            num_in_flight=len(self._in_flight),
            decode=dataclasses.replace(self._decoder.stats),
            num_dropped_multipart=self._num_dropped_multipart,
            num_dropped_unknown_peer=self._num_dropped_unknown_peer,
            num_stale_deltas=self._num_stale_deltas,
            num_send_failures=self._socket.num_send_failures,
            num_workers_lost=self._failover.num_workers_lost,
            num_migrations=dict(self._failover.num_migrations),
        )

    # ---- requests -----------------------------------------------------------------------------

    async def submit(
        self,
        model: str,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        tier: Tier,
        cache_salt: str | None = None,
        trace_context: Mapping[str, str] | None = None,
        tenant: str | None = None,
        context_class: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Send the request to the ready worker of ``model`` the routing policy picks;
        :class:`NoWorkerAvailable` if there is none (or every one we tried turned out to be gone).
        ``arrival_time``: when the client's request arrived (wall clock; None: now), which the
        worker's TTFT deadlines count from (time spent queued in the gateway included)."""
        if self._is_closed:
            raise DispatcherClosed("the gateway's dispatcher is closed")
        if request_id in self._in_flight:
            raise ValueError(f"request {request_id!r} is already in flight")
        submit = Submit(
            request_id=request_id,
            epoch=0,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            tier=tier,
            cache_salt=cache_salt,
            tenant=tenant,
            priority=priority,
            trace_context=dict(trace_context or {}),
            arrival_time=time.time() if arrival_time is None else arrival_time,
        )
        request = InFlight(submit, model, "", asyncio.Queue(), context_class=context_class)
        if not self._place(request):
            raise NoWorkerAvailable(model)
        return RequestStream(request, self._abort)

    def _place(self, request: InFlight, exclude: Collection[str] = ()) -> bool:
        """Send ``request.submit`` to the best worker not in ``exclude``; False if none would take it."""
        tried = set(exclude)
        frame = encode(request.submit)
        submit = request.submit
        route = RouteRequest(
            request_id=submit.request_id,
            model=request.model,
            tier=submit.tier,
            num_prompt_tokens=len(submit.prompt_token_ids),
            context_class=request.context_class,
        )
        prompt = PromptKey(submit.prompt_token_ids, submit.resumed_token_ids, submit.cache_salt)
        while (
            pick := self.registry.pick(request.model, exclude=tried, request=route, prompt=prompt)
        ) is not None:
            worker_id = pick.worker.worker_id
            request.route_scores = dict(pick.scores)
            request.expected_cached_tokens = pick.num_cached_tokens
            self._in_flight.add(request, worker_id)  # before sending, so even an instant answer finds it
            if self._socket.send(worker_id, frame):
                return True
            self._in_flight.remove(request)
            tried.add(worker_id)
        return False

    def _abort(self, request: InFlight) -> None:
        """Stop ``request`` on its worker; a no-op once it is no longer in flight (finished, or moved)."""
        if self._in_flight.remove(request):
            self._send(request.worker_id, Abort(request_id=request.request_id, epoch=request.submit.epoch))

    def _send(self, worker_id: str, message: GatewayMessage) -> bool:
        return self._socket.send(worker_id, encode(message))

    # ---- worker messages: decode, then one handler per type ----------------------------------
    # Token batches and KV events come every engine step and wake nobody; the other messages, and
    # every drop (a counter changed), notify.

    async def _receive_loop(self) -> None:
        while True:
            try:
                parts = await self._socket.recv()
            except zmq.ZMQError:
                log.exception("the ROUTER socket failed; no more worker messages will arrive")
                raise
            try:
                self._on_frames(parts, time.monotonic())
            except Exception:
                log.exception("unexpected error handling a worker message; dropped")

    def _on_frames(self, parts: list[bytes], now: float) -> None:
        if len(parts) != 2:
            self._num_dropped_multipart += 1
            self._notify()
            return
        identity, frame = parts
        message = self._decoder.decode(frame)
        if message is None:
            self._notify()
            return
        self._handlers[type(message)](identity, message, now)

    def _on_token_batch(self, identity: bytes, batch: TokenBatch, now: float) -> None:
        if self._sender(identity, batch, now) is not None:
            for delta in batch.deltas:
                self._on_delta(batch.worker_id, delta)

    def _on_delta(self, worker_id: str, delta: TokenDelta) -> None:
        request = self._in_flight.get(delta.request_id)
        if request is None or request.submit.epoch != delta.epoch or request.worker_id != worker_id:
            self._num_stale_deltas += 1  # aborted, migrated, or finished: nobody waits for it
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
            self._num_stale_deltas += 1
            return
        self.registry.touch(request.worker_id, now)
        self._in_flight.remove(request)
        # 503: the worker began draining after we picked it. It ran nothing, so the same Submit (same
        # epoch) can go to another worker; the client never learns.
        if message.status == 503:
            try:
                if self._place(request, exclude={request.worker_id}):
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
        worker = self.registry.on_heartbeat(heartbeat, now)
        if worker is None:
            self._drop_unknown_peer(identity, "Heartbeat")
            return
        worker.prefix.on_heartbeat(heartbeat.stats.kv_events_seq)
        self._resync_if_stale(worker, now)
        self._notify()

    def _on_drain(self, identity: bytes, notice: DrainNotice, now: float) -> None:
        if not self._is_from(identity, notice):
            return
        if self.registry.on_drain(notice, now) is None:
            self._drop_unknown_peer(identity, "DrainNotice")
            return
        log.info("worker %s draining: %s", notice.worker_id, notice.reason)
        self._notify()

    def _on_register(self, identity: bytes, message: Register, now: float) -> None:
        if not self._is_from(identity, message):
            return
        known = self.registry.get(message.worker_id)
        previous_pid = known.register.pid if known is not None else None
        lost = self.registry.on_register(message, now)
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
        worker = self.registry.get(message.worker_id)
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
        worker = self.registry.touch(message.worker_id, now)
        if worker is None:
            self._drop_unknown_peer(identity, type(message).__name__)
        return worker

    def _drop_unknown_peer(self, identity: bytes, what: str) -> None:
        self._num_dropped_unknown_peer += 1
        if is_logged(self._num_dropped_unknown_peer, LOG_EVERY):
            log.warning(
                "dropped a %s from peer %r: not a registered worker of that id (%d such drops)",
                what,
                identity[:64],
                self._num_dropped_unknown_peer,
            )
        self._notify()
