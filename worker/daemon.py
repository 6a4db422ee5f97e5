"""The worker daemon: the engine loop in the main thread, fed by the socket thread (``daemon_io``).

    loop:  take every queued message (Submit → engine.add_request, Abort, Shutdown)
           engine.step() → one TokenBatch with every delta of the step → publish stats
           idle → block on the inbound queue (with a timeout) instead of spinning

Failover continuation (``Submit.resumed_token_ids``): the tokens the client has already seen are
appended to the prompt the engine runs and ``max_tokens`` is reduced by their count, so the engine
continues exactly where the old worker stopped (the model sees the same context, those tokens computed
as the output rows they were: ``Request.outputs_from``) and emits only what follows them. The request's
detokenizer is then fed those tokens one at a time, as the old worker fed its own, and what it yields is
thrown away (the client has it): it ends in the old worker's state, so a character split across the
resume point, text held back as a possible stop string, and a stop string straddling the resume point
all come out exactly as without the failover. The engine counts them as the client does: as
completion tokens in the usage, not prompt tokens, and as output for the presence and frequency
penalties, as the old worker's did.

Prefix-cache events: after every step that changed the prefix cache, one ``KVEvents`` (numbered
from 0) with the block hashes stored and evicted; ``ResyncKV`` is answered with a ``KVSnapshot`` of
every cached hash. The gateway's routing index of this worker is built from those (gateway/prefix_index.py).

Several gateways (``--connect`` repeated, one link each in ``daemon_io``): a request remembers the link
its Submit came on; its tokens and any Rejected go back on that link only, and only that link's Abort
touches it. Register, heartbeats, DrainNotice and KVEvents go to every gateway (one KVEvents numbering
for all); a ResyncKV is answered to the gateway that asked. Request ids are unique per gateway only,
while the engine knows a request by its id alone: a Submit whose id a request of another gateway holds
is refused with 409 (the gateway's ids are random, so only a misbehaving gateway meets this). A
Shutdown from any gateway stops the worker for all of them.

Drain (``Shutdown(drain=True)`` or SIGTERM): ``DrainNotice`` goes out at once so the gateway stops
routing here; new Submits get ``Rejected(503)``; in-flight requests run to completion; exit code 0.
``Shutdown(drain=False)`` or SIGINT: every in-flight request ends with finish_reason "abort" and the
process exits promptly.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

import msgspec

from policies.feasibility import StepFloor
from telemetry import Telemetry
from wire.errors import InvalidRequestError
from wire.messages import (
    MAX_DELTAS_PER_BATCH,
    MAX_MESSAGE_CHARS,
    Abort,
    DrainNotice,
    GatewayMessage,
    Register,
    Rejected,
    ResyncKV,
    Shutdown,
    Submit,
    TokenBatch,
    TokenDelta,
    WorkerStats,
)
from worker.daemon_io import CurveClientKeys, Received, SocketIO
from worker.daemon_messages import model_name_of, register, token_delta, worker_stats
from worker.engine import Engine
from worker.kv_events import KVEventLog
from worker.liveness import NULL_LIVENESS, Liveness
from worker.outputs import RequestOutput
from worker.request import FinishReason, TierRef
from worker.tracing import NULL_OBSERVER, NullObserver, RequestTracer

log = logging.getLogger(__name__)

ORPHAN_TIMEOUT_S = 10.0  # a gateway link down this long: its requests are nobody's (it has moved them)
IDLE_WAIT_S = 0.5  # idle: how long to block on the inbound queue before looking around again
STEP_TIME_EMA_ALPHA = 0.1


@dataclass(slots=True, frozen=True)
class _Tracked:
    """What the daemon remembers per running request to build its deltas."""

    epoch: int
    link: int  # the gateway that sent its Submit: its tokens go there, only its Abort counts


def _link_of(owner: object) -> int | None:
    return owner.link if isinstance(owner, _Tracked) else None


class WorkerDaemon:
    def __init__(
        self,
        engine: Engine,
        connect: str | Sequence[str],
        worker_id: str,
        *,
        heartbeat_interval_s: float = 0.5,
        model_name: str | None = None,
        telemetry: Telemetry | None = None,
        context_classes: Sequence[str] = (),
        curve: CurveClientKeys | None = None,
        orphan_timeout_s: float = ORPHAN_TIMEOUT_S,
        step_floor: StepFloor | None = None,
        liveness: Liveness = NULL_LIVENESS,
    ) -> None:
        """``connect``: the gateway address, or several (one link each, see the module docstring).
        ``model_name``: what Register announces; by default the name of ``engine.config.model``.
        ``telemetry``: traces of the requests whose Submit carries a trace context (off by default).
        ``curve``: CURVE keys for every link (plain links when None).
        ``orphan_timeout_s``: a gateway's requests are aborted once its link has been down this long.
        ``step_floor``: what worker/calibrate.py measured, announced in Register.
        ``liveness``: beaten once per turn of the loop (after a step or an idle wait), so it goes stale
        only while the engine is stuck in a step (worker/liveness.py)."""
        self.engine = engine
        self._tracing = _observe(engine, telemetry, worker_id)
        self.worker_id = worker_id
        self.model_name = model_name or model_name_of(engine.config.model)
        self.context_classes = list(context_classes)  # what Register announces; empty: every class
        self.orphan_timeout_s = orphan_timeout_s
        self.step_floor = step_floor
        self.liveness = liveness
        self._num_steps = 0
        self._step_time_ema_ms = 0.0
        self._is_draining = False
        self._kv_events = KVEventLog(engine.kv_cache.pool, worker_id, engine.config.block_size)
        self.io = SocketIO(
            connect,
            worker_id,
            self._register(),
            heartbeat_interval_s=heartbeat_interval_s,
            initial_stats=self._stats(),
            curve=curve,
        )

    def run(self) -> int:
        """Serve until a Shutdown (or SIGTERM/SIGINT); returns the process exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        self.io.start()
        try:
            while True:
                self.liveness.beat()  # each turn: a step finished, or an idle wait (<= IDLE_WAIT_S) ended
                stop = self._handle_inbound(block=not self.engine.has_unfinished())
                self._abort_orphans()
                self.io.stats = self._stats()  # a queued request shows in heartbeats during a long step
                if stop is not None and not stop.drain:
                    self._abort_all()
                    break
                if self.engine.has_unfinished():
                    self._step()
                elif self._is_draining:
                    break
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            log.info(
                "worker %s exiting after %d steps; %s",
                self.worker_id,
                self._num_steps,
                self.io.decode_stats_line(),
            )
            self.io.close()
        return 0

    # ---- inbound ------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # SimpleQueue.put is reentrant: safe here, and it wakes the loop if it is blocked on the queue.
        self.io.inbound.put(Shutdown(drain=signum == signal.SIGTERM))

    def _handle_inbound(self, *, block: bool) -> Shutdown | None:
        """Handle every queued message; a non-draining Shutdown is returned for the loop to act on."""
        first = True
        while True:
            try:
                item = self.io.inbound.get(block=block and first, timeout=IDLE_WAIT_S)
            except queue.Empty:
                return None
            first = False
            # A bare Shutdown is our own, from a signal handler.
            stop = self._shutdown(item) if isinstance(item, Shutdown) else self._handle_safely(item)
            if stop is not None:
                return stop

    def _abort_orphans(self) -> None:
        """Drop the requests of a gateway whose link has been down for ``orphan_timeout_s``: it has
        failed them over (or died), and nobody will read their tokens."""
        now = time.monotonic()
        for link, since in enumerate(self.io.down_since):
            if since is None or now - since < self.orphan_timeout_s:
                continue
            orphans = [request_id for request_id, owner in self.engine.owners() if _link_of(owner) == link]
            if orphans:
                log.warning(
                    "worker %s: gateway %s gone for %.0f s; aborting its %d requests",
                    self.worker_id,
                    self.io.addresses[link],
                    now - since,
                    len(orphans),
                )
            for request_id in orphans:
                self._drop(request_id)

    def _handle_safely(self, item: Received) -> Shutdown | None:
        message = item.message
        try:
            return self._handle(message, item.link)
        except Exception:
            request_id = getattr(message, "request_id", None)
            log.exception("unexpected error handling %s for request %s", type(message).__name__, request_id)
            if isinstance(message, Submit):
                tracked = self._tracked(message.request_id)
                if tracked is not None and tracked.link == item.link:
                    self._drop(message.request_id)
                self._reject(
                    message, item.link, 500, "internal", "internal error while admitting the request"
                )
            return None

    def _handle(self, message: GatewayMessage, link: int) -> Shutdown | None:
        if isinstance(message, Submit):
            self._submit(message, link)
        elif isinstance(message, ResyncKV):
            for snapshot in self._kv_events.snapshot():  # to the gateway that asked only
                self.io.send_to(link, snapshot)
        elif isinstance(message, Abort):
            tracked = self._tracked(message.request_id)
            # Only the matching epoch: a late Abort of a failed-over attempt must not kill the new one;
            # and only from the gateway that sent the request.
            if tracked is not None and tracked.epoch == message.epoch and tracked.link == link:
                self._drop(message.request_id)
        else:
            return self._shutdown(message)  # from any gateway: the process stops for every one
        return None

    def _shutdown(self, message: Shutdown) -> Shutdown | None:
        if message.drain:
            if not self._is_draining:
                log.info(
                    "worker %s draining: %d requests in flight", self.worker_id, self.engine.num_requests
                )
                self._is_draining = True
                self.io.send(DrainNotice(worker_id=self.worker_id, reason="shutdown requested"))
            return None
        return message

    def _submit(self, submit: Submit, link: int) -> None:
        if self._is_draining:
            self._reject(submit, link, 503, "worker", f"worker {self.worker_id} is draining; retry elsewhere")
            return
        tracked = self._tracked(submit.request_id)
        if tracked is not None:
            # The engine knows a request by its id alone, and ids are unique per gateway only. The
            # gateway's ids are random (uuid4), so two gateways meet here only by mistake: refuse.
            if tracked.link != link:
                self._reject(
                    submit, link, 409, "request_id", "another gateway runs a request of this id here"
                )
                return
            if submit.epoch <= tracked.epoch:
                why = f"epoch {tracked.epoch} of this request is running"
                self._reject(submit, link, 409, "request_id", why)
                return
            # A newer attempt supersedes the old one: the gateway has already given up on it.
            self._drop(submit.request_id)
        engine = self.engine
        num_resumed = len(submit.resumed_token_ids)
        try:
            submit.validate(vocab_size=engine.model_config.vocab_size, max_model_len=engine.max_model_len)
            sampling = submit.sampling
            if num_resumed:
                sampling = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - num_resumed)
            engine.add_request(
                [*submit.prompt_token_ids, *submit.resumed_token_ids],
                sampling,
                request_id=submit.request_id,
                tier=TierRef(submit.tier.name, submit.tier.rank, submit.tier.ttft_ms, submit.tier.tpot_ms),
                cache_salt=submit.cache_salt,
                tenant=submit.tenant,
                priority=submit.priority,
                seen_token_ids=submit.resumed_token_ids,
                owner=_Tracked(submit.epoch, link),
                arrival_time=monotonic_arrival(submit.arrival_time),
            )
        except InvalidRequestError as exc:
            self._reject(submit, link, 400, exc.field, exc.message)
            return
        self._tracing.begin(submit, len(submit.prompt_token_ids))

    def _drop(self, request_id: str) -> None:
        """Take a request out of the engine (its blocks freed); nothing more is sent for it."""
        self.engine.abort(request_id)

    def _tracked(self, request_id: str) -> _Tracked | None:
        owner = self.engine.owner(request_id)
        return owner if isinstance(owner, _Tracked) else None

    def _reject(self, submit: Submit, link: int, status: int, field: str, message: str) -> None:
        self.io.send_to(
            link,
            Rejected(
                request_id=submit.request_id,
                epoch=submit.epoch,
                status=status,
                field=field,
                message=message[:MAX_MESSAGE_CHARS],
            ),
        )

    # ---- the step -----------------------------------------------------------------------------

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:
            # The engine already confines a failed model step to its requests; this is anything else
            # (sampler, detokenizer). We cannot tell whose fault it was, so everyone running fails.
            log.exception("engine step failed; failing requests %s", [i for i, _ in self.engine.owners()])
            outputs = self._end_all(error="internal error")
        elapsed_ms = (time.perf_counter() - start) * 1000
        self._num_steps += 1
        alpha = STEP_TIME_EMA_ALPHA if self._num_steps > 1 else 1.0
        self._step_time_ema_ms += alpha * (elapsed_ms - self._step_time_ema_ms)
        self._send_outputs(outputs)
        for events in self._kv_events.events():
            self.io.send(events)
        self.io.stats = self._stats()

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        by_link: dict[int, list[TokenDelta]] = {}
        for output in outputs:
            tracked = output.owner
            if not isinstance(tracked, _Tracked):
                continue  # not one the daemon submitted: nobody to send it to
            by_link.setdefault(tracked.link, []).append(token_delta(output, tracked.epoch))
        for link, deltas in by_link.items():  # each gateway gets the tokens of its own requests
            for i in range(0, len(deltas), MAX_DELTAS_PER_BATCH):
                batch = deltas[i : i + MAX_DELTAS_PER_BATCH]
                self.io.send_to(
                    link, TokenBatch(worker_id=self.worker_id, step=self._num_steps, deltas=batch)
                )

    def _abort_all(self) -> None:
        log.info("worker %s stopping now: aborting %d requests", self.worker_id, self.engine.num_requests)
        self._send_outputs(self._end_all(error=None))

    def _end_all(self, *, error: str | None) -> list[RequestOutput]:
        """Drop every request from the engine; their final outputs ("error" or "abort") to send."""
        reason = FinishReason.ERROR if error is not None else FinishReason.ABORT
        return [self.engine.end(request_id, reason, error) for request_id, _ in self.engine.owners()]

    # ---- what we tell the gateway about ourselves ---------------------------------------------

    def _stats(self) -> WorkerStats:
        return worker_stats(self.engine, self._step_time_ema_ms, self._num_steps, self._kv_events.seq)

    def _register(self) -> Register:
        return register(
            self.engine, self.worker_id, self.model_name, self.context_classes, self.step_floor, os.getpid()
        )


def _observe(engine: Engine, telemetry: Telemetry | None, worker_id: str) -> NullObserver:
    """The engine's step observer: request spans when tracing is on, the do-nothing one otherwise."""
    observer = NULL_OBSERVER
    if telemetry is not None and telemetry.enabled:
        observer = RequestTracer(telemetry.tracer, worker_id)
    engine.observer = observer
    return observer


def monotonic_arrival(wall_clock_arrival: float) -> float:
    """A gateway's wall-clock arrival time on this process's ``time.monotonic`` clock: now less the
    time since it (never in the future: a gateway host's clock a little ahead of ours counts as now).
    Hosts are expected to keep their clocks in step (NTP), as traces need them to anyway."""
    return time.monotonic() - max(0.0, time.time() - wall_clock_arrival)
