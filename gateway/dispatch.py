"""The gateway's one ZeroMQ ROUTER: Submit/Abort out, worker messages in, tokens demultiplexed per request.

    submit() ── pick (routing policy) ── Submit ──▶ ROUTER ══▶ worker DEALERs (identity = worker_id)
    RequestStream ◀── asyncio.Queue per request ◀── receive task ◀── TokenBatch / Rejected
                                     registry ◀── receive task ◀── Register / Heartbeat / DrainNotice
          migrate, or WorkerLost ◀── expiry task (no message for heartbeat_timeout_s, or requests
                                     but no engine step for hang_timeout_s), or a new pid registers

The pieces: the socket (gateway/worker_socket.py: sends never wait, so a cancelled consumer can send
its Abort from inside its cancellation); the in-flight table (gateway/in_flight.py), the one record of
which request runs on which worker, which the registry reads too; the worker messages coming in, each
checked against its sender and handed to its handler (gateway/worker_messages.py); and failover
(gateway/failover.py): a lost worker's requests move to another worker with ``epoch + 1``, resuming
after what the client has, or end with WorkerLost. Everything runs on one event loop, so nothing here
is locked. Links are authenticated only with CURVE (the socket's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

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
from gateway.worker_messages import WorkerMessages
from gateway.worker_socket import WorkerSocket
from gateway.workers import PromptKey, WorkerRegistry, WorkerState
from policies.routing import RouteRequest, RoutingPolicy
from wire.codec import DecodeStats, encode
from wire.messages import Abort, GatewayMessage, Submit
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
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()  # set and replaced whenever the registry or counters change
        self._listeners: list[Callable[[], None]] = []
        self._is_closed = False
        self._messages = WorkerMessages(
            self.registry,
            self._in_flight,
            self._failover,
            place=self._place,
            send=self._send,
            notify=self._notify,
        )

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
            decode=dataclasses.replace(self._messages.decoder.stats),
            num_dropped_multipart=self._messages.num_dropped_multipart,
            num_dropped_unknown_peer=self._messages.num_dropped_unknown_peer,
            num_stale_deltas=self._messages.num_stale_deltas,
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

    # ---- worker messages in (gateway/worker_messages.py) --------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            try:
                parts = await self._socket.recv()
            except zmq.ZMQError:
                log.exception("the ROUTER socket failed; no more worker messages will arrive")
                raise
            try:
                self._messages.on_frames(parts, time.monotonic())
            except Exception:
                log.exception("unexpected error handling a worker message; dropped")
