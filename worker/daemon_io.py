"""The worker's socket thread: the one owner of the DEALER socket to the gateway.

ZeroMQ sockets are not thread-safe, and the engine thread must never wait on the network, so all
socket work lives here and the engine talks to it through queues:

    engine thread ── send(msg) ──▶ outbound SimpleQueue ──┐ + a byte on the inproc "wake" PAIR
                                                          ▼
    gateway ROUTER ◀══ tcp/ipc ══▶ DEALER ◀── poll ── I/O thread ── Heartbeat every interval
                                                          │
    engine thread ◀── inbound SimpleQueue ◀── decode ─────┘

Heartbeats are timed here, not by the engine: a long prefill holds the engine thread for seconds,
but torch releases the GIL inside its ops, so this thread keeps the worker visibly alive. The stats
it reports are whatever the engine published last (:attr:`SocketIO.stats`, one reference swap).

``inbound`` is a :class:`queue.SimpleQueue` on purpose: its ``put`` is safe to call from a signal
handler, so SIGTERM/SIGINT are delivered to the engine loop as ordinary ``Shutdown`` messages.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import queue
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from wire.codec import MAX_FRAME_BYTES, encode, gateway_message_decoder
from wire.messages import GatewayMessage, Heartbeat, Register, WorkerMessage, WorkerStats

log = logging.getLogger(__name__)

LINGER_MS = 500  # long enough to flush the last TokenBatch/DrainNotice on exit, short enough to exit
ZMTP_HEARTBEAT_IVL_MS = 1000
ZMTP_HEARTBEAT_TIMEOUT_MS = 5000
REDIAL_GRACE_S = 1.0  # how long to wait for libzmq's own reconnect before dialling again ourselves
MAX_PENDING = 10_000  # frames held while the gateway's pipe is full; beyond this we drop (and log)


class SocketIO:
    """Runs the I/O thread. ``register`` is sent on every (re)connect, so a gateway that restarted, or
    dropped us over an oversize frame, learns who we are again before anything else we send."""

    def __init__(
        self,
        connect: str,
        worker_id: str,
        register: Register,
        *,
        heartbeat_interval_s: float = 0.5,
        initial_stats: WorkerStats,
    ) -> None:
        self.connect = connect
        self.worker_id = worker_id
        self.register = register
        self.heartbeat_interval_s = heartbeat_interval_s
        self.stats = initial_stats  # replaced (never mutated) by the engine thread after each step
        self.inbound: queue.SimpleQueue[GatewayMessage] = queue.SimpleQueue()
        self._outbound: queue.SimpleQueue[WorkerMessage] = queue.SimpleQueue()
        self._decoder = gateway_message_decoder()
        self._num_dropped_multipart = 0
        self._stopping = threading.Event()
        self._ctx = zmq.Context()
        self._wake_addr = f"inproc://worker-io-wake-{id(self)}"
        # Bound before the thread starts so the engine side can connect at once (inproc needs bind first).
        self._wake_recv = self._ctx.socket(zmq.PAIR)
        self._wake_recv.bind(self._wake_addr)
        self._wake_send = self._ctx.socket(zmq.PAIR)  # used by the engine thread only
        self._wake_send.setsockopt(zmq.SNDHWM, 1)  # one pending wake-up is as good as many
        self._wake_send.connect(self._wake_addr)
        self._thread = threading.Thread(target=self._run, name="worker-io", daemon=True)
        # Owned by the I/O thread once it starts.
        self._pending: collections.deque[bytes] = collections.deque()  # encoded, waiting for the pipe
        self._is_connected = False
        self._redial_at: float | None = None

    # ---- engine-thread side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def send(self, message: WorkerMessage) -> None:
        """Queue a message for the gateway; never blocks."""
        self._outbound.put(message)
        self._wake()

    def close(self, timeout_s: float = 2.0) -> None:
        """Flush what is queued (bounded by LINGER), stop the thread and free the sockets."""
        self._stopping.set()
        self._wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("worker I/O thread did not stop within %.1f s", timeout_s)
            return  # it still owns its sockets; the process is exiting anyway
        self._wake_send.close(linger=0)
        self._ctx.term()

    def decode_stats_line(self) -> str:
        s = self._decoder.stats
        return (
            f"decoded {s.decoded}, dropped {s.dropped_oversize} oversize / {s.dropped_malformed} malformed / "
            f"{s.dropped_version} other-version / {self._num_dropped_multipart} multipart frames"
        )

    def _wake(self) -> None:
        # Again: a wake-up is already pending, and the I/O thread reads every queued message per wake.
        with contextlib.suppress(zmq.Again):
            self._wake_send.send(b"", zmq.NOBLOCK)

    # ---- I/O thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt_string(zmq.IDENTITY, self.worker_id)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # libzmq drops a peer that sends more
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        sock.connect(self.connect)
        log.info("worker %s connecting to %s", self.worker_id, self.connect)
        try:
            self._loop(sock, monitor)
        except Exception:
            log.exception("worker I/O thread failed")
        finally:
            log.info("worker I/O closing: %s", self.decode_stats_line())
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close()  # LINGER_MS to flush
            self._wake_recv.close(linger=0)

    def _loop(self, sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        heartbeat_seq = itertools.count()
        next_heartbeat = time.monotonic()
        while True:
            stopping = self._stopping.is_set()
            now = time.monotonic()
            # Stats are read *before* the outbound queue is drained: the engine publishes them after
            # queueing its step's TokenBatch, so a heartbeat never overtakes a message the engine sent
            # before the state it reports (a gateway may read "0 running" as "nothing more is coming").
            stats = self.stats
            while True:
                try:
                    self._queue_frame(self._outbound.get_nowait())
                except queue.Empty:
                    break
            self._flush(sock)
            if stopping:
                return  # after one last flush of everything queued before close()
            if self._redial_at is not None and now >= self._redial_at:
                self._redial(sock)

            if self._is_connected and now >= next_heartbeat:
                # Not queued behind a backlog: a heartbeat that cannot go now is stale by the next one.
                if not self._pending:
                    self._try_send(sock, encode(self._heartbeat(next(heartbeat_seq), stats)))
                next_heartbeat = now + self.heartbeat_interval_s
            wake_at = [t for t in (self._redial_at,) if t is not None]
            if self._is_connected:
                wake_at.append(next_heartbeat)
            if self._pending:
                wake_at.append(now + 0.1)  # POLLOUT covers most; this covers a pipe that went away
            poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if self._pending else 0))
            timeout_ms = math.ceil(max(0.0, min(wake_at) - time.monotonic()) * 1000) if wake_at else None
            events = dict(poller.poll(timeout_ms))

            if self._wake_recv in events:
                self._drain_wakeups()
            if monitor in events and self._on_monitor_events(monitor):
                next_heartbeat = time.monotonic()
            if events.get(sock, 0) & zmq.POLLIN:
                self._receive_all(sock)

    def _queue_frame(self, message: WorkerMessage, *, first: bool = False) -> None:
        try:
            frame = encode(message)
        except ValueError:
            log.exception("dropping an unsendable %s", type(message).__name__)
            return
        if len(self._pending) >= MAX_PENDING:
            log.error("gateway not reading: dropping a %s (%d held)", type(message).__name__, MAX_PENDING)
        elif first:
            self._pending.appendleft(frame)
        else:
            self._pending.append(frame)

    def _on_monitor_events(self, monitor: zmq.Socket[bytes]) -> bool:
        """Track the connection; True when it has just come up."""
        connected_now = False
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                log.info("worker %s connected to %s; sending Register", self.worker_id, self.connect)
                # First in line: the gateway must know us before it sees our heartbeats or tokens.
                self._queue_frame(self.register, first=True)
                self._is_connected = connected_now = True
                self._redial_at = None
            elif event == zmq.EVENT_DISCONNECTED:
                log.warning("worker %s lost its connection to %s", self.worker_id, self.connect)
                self._is_connected = False
                # libzmq reconnects after a network error but gives up for good after a protocol
                # error (the gateway sent a frame over MAXMSGSIZE, or garbage ZMTP). Its retry
                # announces itself at once; if none comes, we dial again ourselves.
                self._redial_at = time.monotonic() + REDIAL_GRACE_S
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self._redial_at = None
        return connected_now

    def _redial(self, sock: zmq.Socket[bytes]) -> None:
        log.warning(
            "worker %s: libzmq will not reconnect to %s; dialling again", self.worker_id, self.connect
        )
        self._redial_at = None
        with contextlib.suppress(zmq.ZMQError):  # ENOENT: libzmq already forgot the endpoint
            sock.disconnect(self.connect)
        sock.connect(self.connect)

    def _heartbeat(self, seq: int, stats: WorkerStats) -> Heartbeat:
        return Heartbeat(worker_id=self.worker_id, seq=seq, sent_at=time.time(), stats=stats)

    def _drain_wakeups(self) -> None:
        while True:
            try:
                self._wake_recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _receive_all(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(parts) != 1:
                # One message, one frame: anything else is not from a gateway speaking this protocol.
                self._num_dropped_multipart += 1
                if self._num_dropped_multipart == 1 or self._num_dropped_multipart % 1000 == 0:
                    log.warning("dropped a %d-part message (%s)", len(parts), self.decode_stats_line())
                continue
            message = self._decoder.decode(parts[0])
            if message is not None:
                self.inbound.put(message)

    def _flush(self, sock: zmq.Socket[bytes]) -> None:
        while self._pending and self._try_send(sock, self._pending[0]):
            self._pending.popleft()

    @staticmethod
    def _try_send(sock: zmq.Socket[bytes], frame: bytes) -> bool:
        try:
            sock.send(frame, zmq.NOBLOCK, copy=len(frame) < 64 * 1024)
        except zmq.Again:
            return False  # the gateway's pipe is full (or not there yet): keep it for later
        return True
