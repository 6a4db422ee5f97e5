"""The worker's socket thread: the one owner of its DEALER sockets, one per gateway it dials.

ZeroMQ sockets are not thread-safe, and the engine thread must never wait on the network, so all
socket work lives here and the engine talks to it through queues:

    engine thread ── send / send_to ──▶ outbound SimpleQueue ──┐ + a byte on the inproc "wake" PAIR
                                                               ▼
    gateway 0 ROUTER ◀══ tcp/ipc ══▶ DEALER (link 0) ◀─┐
    gateway 1 ROUTER ◀══ tcp/ipc ══▶ DEALER (link 1) ◀─┴ poll ── I/O thread ── Heartbeat per link
                                                               │
    engine thread ◀── inbound SimpleQueue of Received(link, message) ◀── decode

Several gateways can share one worker (``--connect`` repeated): each link has its own socket, its
own queue of frames waiting for that gateway's pipe, its own heartbeats and its own Register on every
(re)connect. ``send`` goes to every gateway (Register, Heartbeat, DrainNotice, KVEvents: each gateway
keeps its own view of the worker, with the same KVEvents numbering); ``send_to`` to one (a request's
tokens, a Rejected, a KVSnapshot). Sends never block: a gateway that is gone or not reading fills its
own bounded queue and then loses frames, while the others go on.

Heartbeats are timed here, not by the engine: a long prefill holds the engine thread for seconds,
but torch releases the GIL inside its ops, so this thread keeps the worker visibly alive. The stats
it reports are whatever the engine published last (:attr:`SocketIO.stats`, one reference swap).

``inbound`` is a :class:`queue.SimpleQueue` on purpose: its ``put`` is safe to call from a signal
handler, so SIGTERM/SIGINT are delivered to the engine loop as ordinary ``Shutdown`` messages (put
bare: a message of this process, from no gateway).

CURVE (``CurveClientKeys``): every DEALER is a CURVE client with the worker's key pair and that
gateway's public key; a link counts as up only once its handshake succeeded.
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
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from wire.codec import MAX_FRAME_BYTES, encode, gateway_message_decoder
from wire.curve import CurveKeyPair
from wire.log_every import is_logged
from wire.messages import GatewayMessage, Heartbeat, Register, Shutdown, WorkerMessage, WorkerStats

log = logging.getLogger(__name__)

LINGER_MS = 500  # long enough to flush the last TokenBatch/DrainNotice on exit, short enough to exit
ZMTP_HEARTBEAT_IVL_MS = 1000
ZMTP_HEARTBEAT_TIMEOUT_MS = 5000
REDIAL_GRACE_S = 1.0  # how long to wait for libzmq's own reconnect before dialling again ourselves
MAX_PENDING = 10_000  # frames held per link while its gateway's pipe is full; beyond this we drop (and log)
LOG_EVERY = 1000  # repeated trouble on a link (drops, failed handshakes) is logged once, then every Nth
# A link is up once its handshake succeeded (plain or CURVE). The HANDSHAKE_* events are stable from
# libzmq 4.3 on (pyzmq's wheels bundle 4.3.x); an older libzmq would never bring a link up.
MIN_LIBZMQ = (4, 3)
MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
)


@dataclass(frozen=True, slots=True)
class Received:
    """A message from the gateway of link ``link`` (an index into ``SocketIO.addresses``)."""

    link: int
    message: GatewayMessage


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    """The worker's CURVE key pair and each gateway's public key, in ``--connect`` order."""

    key_pair: CurveKeyPair
    server_keys: tuple[bytes, ...]


@dataclass(slots=True)
class _Link:
    """One gateway, as the I/O thread sees it."""

    index: int
    address: str
    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    pending: collections.deque[bytes] = field(default_factory=collections.deque)  # waiting for its pipe
    is_connected: bool = False
    redial_at: float | None = None
    next_heartbeat: float = 0.0
    heartbeat_seq: itertools.count[int] = field(default_factory=itertools.count)
    num_dropped: int = 0  # frames lost because its queue was full
    num_failed_handshakes: int = 0  # since it was last up


class SocketIO:
    """Runs the I/O thread. ``register`` is sent on every (re)connect of every link, so a gateway that
    restarted, or dropped us over an oversize frame, learns who we are before anything else we send."""

    def __init__(
        self,
        connect: str | Sequence[str],
        worker_id: str,
        register: Register,
        *,
        heartbeat_interval_s: float = 0.5,
        initial_stats: WorkerStats,
        curve: CurveClientKeys | None = None,
    ) -> None:
        if zmq.zmq_version_info() < MIN_LIBZMQ:
            raise RuntimeError(f"the worker needs libzmq >= 4.3, this pyzmq has {zmq.zmq_version()}")
        self.addresses = (connect,) if isinstance(connect, str) else tuple(connect)
        if not self.addresses:
            raise ValueError("a worker needs at least one gateway address")
        if curve is not None and len(curve.server_keys) != len(self.addresses):
            raise ValueError(f"{len(curve.server_keys)} CURVE server keys for {len(self.addresses)} gateways")
        self.worker_id = worker_id
        self.register = register
        self.heartbeat_interval_s = heartbeat_interval_s
        self.stats = initial_stats  # replaced (never mutated) by the engine thread after each step
        # A gateway's message, or this process's own Shutdown (from a signal handler).
        self.inbound: queue.SimpleQueue[Received | Shutdown] = queue.SimpleQueue()
        self._curve = curve
        self._outbound: queue.SimpleQueue[tuple[int | None, WorkerMessage]] = queue.SimpleQueue()
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
        # Per link: monotonic time it went down (None while up, or before it first came up). Written by
        # the I/O thread, read by the engine thread (one float per slot: no lock needed).
        self.down_since: list[float | None] = [None] * len(self.addresses)

    # ---- engine-thread side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def send(self, message: WorkerMessage) -> None:
        """Queue a message for every gateway; never blocks."""
        self._outbound.put((None, message))
        self._wake()

    def send_to(self, link: int, message: WorkerMessage) -> None:
        """Queue a message for the gateway of ``link`` only; never blocks."""
        self._outbound.put((link, message))
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
        links = [self._open(index, address) for index, address in enumerate(self.addresses)]
        try:
            self._loop(links)
        except Exception:
            log.exception("worker I/O thread failed")
        finally:
            log.info("worker I/O closing: %s", self.decode_stats_line())
            for link in links:
                link.sock.disable_monitor()
                link.monitor.close(linger=0)
                link.sock.close()  # LINGER_MS to flush
            self._wake_recv.close(linger=0)

    def _open(self, index: int, address: str) -> _Link:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt_string(zmq.IDENTITY, self.worker_id)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # libzmq drops a peer that sends more
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
        if self._curve is not None:
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.key_pair.public_key)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.key_pair.secret_key)
            sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve.server_keys[index])
        monitor = sock.get_monitor_socket(MONITOR_EVENTS)
        sock.connect(address)
        log.info("worker %s connecting to %s (link %d)", self.worker_id, address, index)
        return _Link(index, address, sock, monitor)

    def _loop(self, links: list[_Link]) -> None:
        poller = zmq.Poller()
        for link in links:
            poller.register(link.sock, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        register = encode(self.register)
        while True:
            stopping = self._stopping.is_set()
            now = time.monotonic()
            # Stats are read *before* the outbound queue is drained: the engine publishes them after
            # queueing its step's TokenBatch, so a heartbeat never overtakes a message the engine sent
            # before the state it reports (a gateway may read "0 running" as "nothing more is coming").
            stats = self.stats
            self._take_outbound(links)
            for link in links:
                self._flush(link)
            if stopping:
                return  # after one last flush of everything queued before close()
            wake_at: list[float] = []
            for link in links:
                if link.redial_at is not None and now >= link.redial_at:
                    self._redial(link)
                if link.is_connected and now >= link.next_heartbeat:
                    # Not queued behind a backlog: a heartbeat that cannot go now is stale by the next one.
                    if not link.pending:
                        heartbeat = self._heartbeat(next(link.heartbeat_seq), stats)
                        self._try_send(link.sock, encode(heartbeat))
                    link.next_heartbeat = now + self.heartbeat_interval_s
                if link.redial_at is not None:
                    wake_at.append(link.redial_at)
                if link.is_connected:
                    wake_at.append(link.next_heartbeat)
                if link.pending:
                    wake_at.append(now + 0.1)  # POLLOUT covers most; this covers a pipe that went away
                poller.modify(link.sock, zmq.POLLIN | (zmq.POLLOUT if link.pending else 0))
            timeout_ms = math.ceil(max(0.0, min(wake_at) - time.monotonic()) * 1000) if wake_at else None
            events = dict(poller.poll(timeout_ms))

            if self._wake_recv in events:
                self._drain_wakeups()
            for link in links:
                if link.monitor in events and self._on_monitor_events(link, register):
                    link.next_heartbeat = time.monotonic()
                if events.get(link.sock, 0) & zmq.POLLIN:
                    self._receive_all(link)

    def _take_outbound(self, links: list[_Link]) -> None:
        while True:
            try:
                target, message = self._outbound.get_nowait()
            except queue.Empty:
                return
            try:
                frame = encode(message)  # once, however many gateways it goes to
            except ValueError:
                log.exception("dropping an unsendable %s", type(message).__name__)
                continue
            for link in links if target is None else links[target : target + 1]:
                self._queue_frame(link, frame, type(message).__name__)

    def _queue_frame(self, link: _Link, frame: bytes, what: str, *, first: bool = False) -> None:
        if len(link.pending) >= MAX_PENDING:
            link.num_dropped += 1
            if is_logged(link.num_dropped, LOG_EVERY):
                log.error(
                    "gateway at %s not reading: dropping a %s (%d held, %d dropped so far)",
                    link.address,
                    what,
                    MAX_PENDING,
                    link.num_dropped,
                )
        elif first:
            link.pending.appendleft(frame)
        else:
            link.pending.append(frame)

    def _on_monitor_events(self, link: _Link, register: bytes) -> bool:
        """Track the link; True when it has just come up."""
        connected_now = False
        while link.monitor.poll(0):
            event = recv_monitor_message(link.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                log.info("worker %s connected to %s; sending Register", self.worker_id, link.address)
                # First in line: the gateway must know us before it sees our heartbeats or tokens.
                self._queue_frame(link, register, "Register", first=True)
                link.is_connected = connected_now = True
                self.down_since[link.index] = None
                link.redial_at = None
                link.num_failed_handshakes = 0
            elif event == zmq.EVENT_DISCONNECTED:
                if link.is_connected:
                    log.warning("worker %s lost its connection to %s", self.worker_id, link.address)
                    self.down_since[link.index] = time.monotonic()
                link.is_connected = False
                # libzmq reconnects after a network error but gives up for good after a protocol
                # error (the gateway sent a frame over MAXMSGSIZE, or garbage ZMTP) or a refused
                # CURVE key. Its retry announces itself at once; if none comes, we dial again ourselves.
                link.redial_at = time.monotonic() + REDIAL_GRACE_S
            elif event == zmq.EVENT_CONNECT_RETRIED:
                link.redial_at = None
            else:
                self._on_failed_handshake(link, event)
        return connected_now

    def _on_failed_handshake(self, link: _Link, event: int) -> None:
        link.num_failed_handshakes += 1
        if not is_logged(link.num_failed_handshakes, LOG_EVERY):
            return
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = "the gateway refused this worker's CURVE key (not in its curve_authorized_keys_dir?)"
        elif self._curve is None:
            why = "does the gateway require CURVE? give --curve-secret-key-file and --curve-server-key-file"
        else:
            why = "is --curve-server-key-file that gateway's public key, and does it use CURVE?"
        log.error(
            "worker %s: handshake with %s failed (%d times): %s",
            self.worker_id,
            link.address,
            link.num_failed_handshakes,
            why,
        )

    def _redial(self, link: _Link) -> None:
        log.log(
            logging.WARNING if link.num_failed_handshakes == 0 else logging.DEBUG,
            "worker %s: libzmq will not reconnect to %s; dialling again",
            self.worker_id,
            link.address,
        )
        link.redial_at = None
        with contextlib.suppress(zmq.ZMQError):  # ENOENT: libzmq already forgot the endpoint
            link.sock.disconnect(link.address)
        link.sock.connect(link.address)

    def _heartbeat(self, seq: int, stats: WorkerStats) -> Heartbeat:
        return Heartbeat(worker_id=self.worker_id, seq=seq, sent_at=time.time(), stats=stats)

    def _drain_wakeups(self) -> None:
        while True:
            try:
                self._wake_recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _receive_all(self, link: _Link) -> None:
        while True:
            try:
                parts = link.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(parts) != 1:
                # One message, one frame: anything else is not from a gateway speaking this protocol.
                self._num_dropped_multipart += 1
                if is_logged(self._num_dropped_multipart, LOG_EVERY):
                    log.warning("dropped a %d-part message (%s)", len(parts), self.decode_stats_line())
                continue
            message = self._decoder.decode(parts[0])
            if message is not None:
                self.inbound.put(Received(link.index, message))

    def _flush(self, link: _Link) -> None:
        while link.pending and self._try_send(link.sock, link.pending[0]):
            link.pending.popleft()

    @staticmethod
    def _try_send(sock: zmq.Socket[bytes], frame: bytes) -> bool:
        try:
            sock.send(frame, zmq.NOBLOCK, copy=len(frame) < 64 * 1024)
        except zmq.Again:
            return False  # the gateway's pipe is full (or not there yet): keep it for later
        return True
