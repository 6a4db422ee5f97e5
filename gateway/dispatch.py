"""The gateway's one ZeroMQ ROUTER: Submit/Abort out, worker messages in, tokens demultiplexed per request.

    submit() ── pick (routing policy) ── Submit ──▶ ROUTER ══▶ worker DEALERs (identity = worker_id)
    RequestStream ◀── asyncio.Queue per request ◀── receive task ◀── TokenBatch / Rejected
                                     registry ◀── receive task ◀── Register / Heartbeat / DrainNotice
          migrate, or WorkerLost ◀── expiry task (no message for heartbeat_timeout_s, or requests
                                     but no engine step for hang_timeout_s), or a new pid registers

Migration: a lost worker's requests are re-sent to a healthy worker of the same model as
``Submit(epoch + 1, resumed_token_ids = every token already queued for the client)``. The worker
treats those tokens as generated and sends only what follows, so the stream goes on with nothing lost
or repeated (exactly so for greedy sampling); the old worker's late deltas carry the old epoch and are
dropped (and answered with an Abort). After ``max_migrations`` moves, or with no healthy worker left,
the stream ends with WorkerLost (the client sees an error event), never a hang.

Everything runs on one event loop, so nothing here is locked. Sends are never awaited: they go out with
DONTWAIT and either succeed at once or fail (ROUTER_MANDATORY turns "that worker is gone" into an error
instead of a silent drop), which lets a cancelled consumer send its Abort from inside its cancellation.

Trust: a frame is only believed from the connection it claims to come from (the ROUTER identity must be
the worker id it names, and a delta must come from the worker its request was sent to, with the current
epoch); anything else is counted and dropped. With CURVE (``gateway.curve_*``, gateway/link_security.py)
only workers holding an authorized key get a link at all; without it, identities are not authenticated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from gateway.link_security import CurveServer, CurveServerKeys
from gateway.request_stream import (
    DispatcherClosed,
    DispatchError,
    InFlight,
    NoWorkerAvailable,
    RequestStream,
    WorkerLost,
    WorkerRejected,
)
from gateway.workers import PromptKey, RoutingError, WorkerInfo, WorkerRegistry, WorkerState
from policies.routing import RouteRequest, RoutingPolicy
from wire.codec import MAX_FRAME_BYTES, DecodeStats, encode, worker_message_decoder
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

LINGER_MS = 200  # on close: long enough to flush the Aborts of in-flight requests
ZMTP_HEARTBEAT_IVL_MS = 1000  # libzmq notices a half-open TCP link on its own, as the worker side does
ZMTP_HEARTBEAT_TIMEOUT_MS = 5000


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
    """Owns the ROUTER socket, the worker registry and the in-flight requests of this gateway."""

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
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.max_migrations = max_migrations
        self.registry = WorkerRegistry(routing)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting worker replaces its old pipe
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone worker raises, never drops
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.LINGER, LINGER_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
        self._curve = CurveServer(self._ctx, self._sock, curve) if curve is not None else None
        try:
            self._sock.bind(bind)
        except zmq.ZMQError:  # in use, or a bad address: free what we made, so the caller can report it
            if self._curve is not None:
                self._curve.stop()
            self._sock.close(linger=0)
            self._ctx.term()
            raise
        # The real endpoint: tcp://127.0.0.1:0 binds an ephemeral port that workers need to know.
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = worker_message_decoder()
        self._requests: dict[str, InFlight] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()  # set and replaced whenever the registry or counters change
        self._listeners: list[Callable[[], None]] = []
        self._is_closed = False
        self._num_dropped_multipart = 0
        self._num_dropped_unknown_peer = 0
        self._num_stale_deltas = 0
        self._num_send_failures = 0
        self._num_workers_lost = 0
        self._num_migrations: dict[str, int] = {}

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="dispatch-receive"),
            asyncio.create_task(self._expire_loop(), name="dispatch-expire"),
        ]
        if self._curve is not None:
            self._tasks.append(asyncio.create_task(self._curve.watch(), name="dispatch-curve"))

    async def close(self) -> None:
        """Abort every in-flight request (their streams end with DispatcherClosed) and free the socket."""
        if self._is_closed:
            return
        self._is_closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for request in list(self._requests.values()):
            self._abort(request)
            request.queue.put_nowait(DispatcherClosed("the gateway's dispatcher is shutting down"))
        if self._curve is not None:
            self._curve.stop()
        self._sock.close(linger=LINGER_MS)
        self._ctx.term()

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

    def stats(self) -> DispatchStats:
        count = self.registry.num_in_state
        return DispatchStats(
            num_workers_ready=count(WorkerState.READY),
            num_workers_draining=count(WorkerState.DRAINING),
            num_workers_dead=count(WorkerState.DEAD),
            num_in_flight=len(self._requests),
            decode=dataclasses.replace(self._decoder.stats),
            num_dropped_multipart=self._num_dropped_multipart,
            num_dropped_unknown_peer=self._num_dropped_unknown_peer,
            num_stale_deltas=self._num_stale_deltas,
            num_send_failures=self._num_send_failures,
            num_workers_lost=self._num_workers_lost,
            num_migrations=dict(self._num_migrations),
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
    ) -> RequestStream:
        """Send the request to the ready worker of ``model`` the routing policy picks;
        :class:`NoWorkerAvailable` if there is none (or every one we tried turned out to be gone)."""
        if self._is_closed:
            raise DispatcherClosed("the gateway's dispatcher is closed")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        submit = Submit(
            request_id=request_id,
            epoch=0,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            tier=tier,
            cache_salt=cache_salt,
            tenant=tenant,
            trace_context=dict(trace_context or {}),
            arrival_time=time.time(),
        )
        request = InFlight(submit, model, "", asyncio.Queue(), context_class=context_class)
        if not self._place(request, exclude=set()):
            raise NoWorkerAvailable(model)
        return RequestStream(request, self._abort)

    def _place(self, request: InFlight, exclude: set[str]) -> bool:
        """Send ``request.submit`` to the best worker not in ``exclude``; False if none would take it."""
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
            pick := self.registry.pick(request.model, exclude=exclude, request=route, prompt=prompt)
        ) is not None:
            worker = pick.worker
            # Tracked before sending, so even an instant answer finds its queue.
            request.worker_id = worker.worker_id
            request.route_scores = dict(pick.scores)
            request.expected_cached_tokens = pick.num_cached_tokens
            self._requests[request.request_id] = request
            worker.in_flight_ids.add(request.request_id)
            if self._send_frame(worker.worker_id, frame):
                return True
            self._forget(request)
            exclude.add(worker.worker_id)
        return False

    def _abort(self, request: InFlight) -> None:
        if self._requests.get(request.request_id) is request:
            self._forget(request)
            self._send(request.worker_id, Abort(request_id=request.request_id, epoch=request.submit.epoch))

    def _forget(self, request: InFlight) -> None:
        del self._requests[request.request_id]
        worker = self.registry.get(request.worker_id)
        if worker is not None:
            worker.in_flight_ids.discard(request.request_id)

    def _fail_over(self, request: InFlight, reason: str) -> None:
        """The worker running ``request`` is gone: move the request to another worker, or end its
        stream with WorkerLost when it may not move again or nowhere can take it."""
        lost_worker_id = request.worker_id
        self._forget(request)
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
        if len(request.token_ids) >= submit.sampling.max_tokens:
            # Its last token arrived without a finish (cannot happen with our workers): nothing to resume.
            return "every token it may generate was already sent"
        request.submit = msgspec.structs.replace(
            submit, epoch=submit.epoch + 1, resumed_token_ids=list(request.token_ids)
        )
        request.num_migrations += 1
        try:
            placed = self._place(request, exclude=set())
        except RoutingError:
            log.exception("routing failed migrating request %s", request.request_id)
            placed = False
        if not placed:
            return f"no healthy worker of model {request.model!r} to move it to"
        self._num_migrations[request.model] = self._num_migrations.get(request.model, 0) + 1
        log.info(
            "request %s migrated to worker %s (epoch %d, resuming after %d tokens)",
            request.request_id,
            request.worker_id,
            request.submit.epoch,
            len(request.token_ids),
        )
        return None

    def _on_worker_lost(self, worker: WorkerInfo, request_ids: set[str], reason: str) -> None:
        self._num_workers_lost += 1
        log.warning("worker %s lost (%s); %d requests in flight", worker.worker_id, reason, len(request_ids))
        # A snapshot: a migration may place a request back on this worker (a new process that re-registered).
        lost = list(request_ids)
        request_ids.clear()
        for request_id in lost:
            request = self._requests.get(request_id)
            if request is not None and request.worker_id == worker.worker_id:
                # Best effort: a worker that was only stalled frees the blocks when it wakes.
                self._send(worker.worker_id, Abort(request_id=request_id, epoch=request.submit.epoch))
                self._fail_over(request, reason)

    # ---- sockets ------------------------------------------------------------------------------

    def _send(self, worker_id: str, message: GatewayMessage) -> bool:
        return self._send_frame(worker_id, encode(message))

    def _send_frame(self, worker_id: str, frame: bytes) -> bool:
        if self._sock.closed:
            return False
        # DONTWAIT: pyzmq tries the send at once and hands back a finished future; nothing is awaited.
        future = self._sock.send_multipart([worker_id.encode(), frame], flags=zmq.DONTWAIT)
        error = future.exception() if isinstance(future, asyncio.Future) and future.done() else None
        if error is not None:
            self._num_send_failures += 1
            log.warning("could not send to worker %s: %s", worker_id, error)
            return False
        return True

    async def _receive_loop(self) -> None:
        while True:
            try:
                parts = await self._sock.recv_multipart()
            except zmq.ZMQError:
                log.exception("the ROUTER socket failed; no more worker messages will arrive")
                raise
            try:
                self._on_frames(parts, time.monotonic())
            except Exception:
                log.exception("unexpected error handling a worker message; dropped")

    async def _expire_loop(self) -> None:
        # A quarter of the shorter timeout: a worker is ejected at most 1.25x its timeout after it stops.
        interval_s = min(self.heartbeat_timeout_s, self.hang_timeout_s) / 4
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            silent = self.registry.expire(now, self.heartbeat_timeout_s)
            for worker in silent:
                self._on_worker_lost(
                    worker, worker.in_flight_ids, f"no message for {self.heartbeat_timeout_s} s"
                )
            hung = self.registry.expire_hung(now, self.hang_timeout_s)
            for worker in hung:
                reason = f"requests but no engine step for {self.hang_timeout_s} s"
                self._on_worker_lost(worker, worker.in_flight_ids, reason)
            if silent or hung:
                self._notify()

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the loop, not awaited) whenever the registry may have changed."""
        self._listeners.append(callback)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        for callback in self._listeners:
            callback()

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
        if isinstance(message, Rejected):
            self._on_rejected(identity, message, now)
            return
        if message.worker_id.encode() != identity:
            self._drop_unknown_peer(identity, type(message).__name__)
            return
        if isinstance(message, TokenBatch):
            if self.registry.touch(message.worker_id, now) is None:
                self._drop_unknown_peer(identity, "TokenBatch")
                return
            for delta in message.deltas:
                self._on_delta(message.worker_id, delta)
            return
        if isinstance(message, KVEvents | KVSnapshot):
            # Every step's cache changes: routing reads them, nobody waits on them (no notify).
            info = self.registry.touch(message.worker_id, now)
            if info is None:
                self._drop_unknown_peer(identity, type(message).__name__)
            elif isinstance(message, KVEvents):
                info.prefix.on_events(message)
                self._resync_if_stale(info, now)
            else:
                info.prefix.on_snapshot(message)
                self._resync_if_stale(info, now)
            return
        if isinstance(message, Register):
            self._on_register(message, now)
        elif isinstance(message, Heartbeat):
            info = self.registry.on_heartbeat(message, now)
            if info is None:
                self._drop_unknown_peer(identity, "Heartbeat")
            else:
                info.prefix.on_heartbeat(message.stats.kv_events_seq)
                self._resync_if_stale(info, now)
        elif isinstance(message, DrainNotice):
            if self.registry.on_drain(message, now) is None:
                self._drop_unknown_peer(identity, "DrainNotice")
            else:
                log.info("worker %s draining: %s", message.worker_id, message.reason)
        self._notify()

    def _on_register(self, message: Register, now: float) -> None:
        known = self.registry.get(message.worker_id)
        previous_pid = known.register.pid if known is not None else None
        lost = self.registry.on_register(message, now)
        log.info(
            "worker %s registered: model %s, pid %d (before: %s), %d KV blocks, context %d",
            message.worker_id,
            message.model,
            message.pid,
            previous_pid,
            message.num_kv_blocks,
            message.max_model_len,
        )
        worker = self.registry.get(message.worker_id)
        assert worker is not None
        self._resync_if_stale(worker, now)  # a new index, for a new process or a new link
        if lost:
            self._on_worker_lost(worker, lost, f"restarted (pid {previous_pid} → {message.pid})")

    def _resync_if_stale(self, worker: WorkerInfo, now: float) -> None:
        """Ask for a KVSnapshot when the worker's prefix index can no longer be trusted."""
        if worker.prefix.wants_resync(now):
            log.debug("asking worker %s for its prefix cache (resync %d)", worker.worker_id,
                      worker.prefix.num_resyncs)  # fmt: skip
            self._send(worker.worker_id, ResyncKV())

    def _on_delta(self, worker_id: str, delta: TokenDelta) -> None:
        request = self._requests.get(delta.request_id)
        if request is None or request.submit.epoch != delta.epoch or request.worker_id != worker_id:
            self._num_stale_deltas += 1  # aborted, migrated, or finished: nobody waits for it
            if delta.finish_reason is None:
                # Still running there (an ejected worker that woke up, or our Abort was lost with the
                # link): stop it. The epoch keeps this from touching a newer attempt on that worker.
                self._send(worker_id, Abort(request_id=delta.request_id, epoch=delta.epoch))
            return
        request.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            self._forget(request)
        request.queue.put_nowait(delta)

    def _on_rejected(self, identity: bytes, message: Rejected, now: float) -> None:
        request = self._requests.get(message.request_id)
        if request is None or request.submit.epoch != message.epoch or request.worker_id.encode() != identity:
            self._num_stale_deltas += 1
            return
        self.registry.touch(request.worker_id, now)
        self._forget(request)
        # 503: the worker began draining after we picked it. It ran nothing, so the same Submit (same
        # epoch) can go to another worker; the client never learns.
        if message.status == 503:
            try:
                if self._place(request, exclude={request.worker_id}):
                    return
            except RoutingError:
                log.exception("routing failed re-placing request %s", request.request_id)
        request.queue.put_nowait(WorkerRejected(message.status, message.field, message.message))

    def _drop_unknown_peer(self, identity: bytes, what: str) -> None:
        self._num_dropped_unknown_peer += 1
        if self._num_dropped_unknown_peer == 1 or self._num_dropped_unknown_peer % 1000 == 0:
            log.warning(
                "dropped a %s from peer %r: not a registered worker of that id (%d such drops)",
                what,
                identity[:64],
                self._num_dropped_unknown_peer,
            )
        self._notify()
