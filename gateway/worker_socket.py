"""The gateway's one ROUTER socket, which every worker's DEALER dials (its identity is the worker id).

Sends are never awaited: they go out with DONTWAIT and either succeed at once or fail (ROUTER_MANDATORY
turns "that worker is gone" into an error instead of a silent drop), which lets a cancelled consumer
send its Abort from inside its cancellation. With CURVE (``gateway.curve_*``, gateway/link_security.py)
only workers holding an authorized key get a link at all; without it, identities are not authenticated.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from gateway.link_security import CurveServer, CurveServerKeys
from wire.codec import MAX_FRAME_BYTES

__all__ = ["WorkerSocket"]

log = logging.getLogger(__name__)

LINGER_MS = 200  # on close: long enough to flush the Aborts of in-flight requests
ZMTP_HEARTBEAT_IVL_MS = 1000  # libzmq notices a half-open TCP link on its own, as the worker side does
ZMTP_HEARTBEAT_TIMEOUT_MS = 5000


class WorkerSocket:
    """The bound ROUTER, its CURVE server when given keys, and the count of sends that failed."""

    def __init__(self, bind: str, curve: CurveServerKeys | None = None) -> None:
        """Bind to ``bind``; a ``zmq.ZMQError`` (in use, a bad address) frees everything made first."""
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting worker replaces its old pipe
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone worker raises, never drops
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.LINGER, LINGER_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
        self.curve = CurveServer(self._ctx, self._sock, curve) if curve is not None else None
        try:
            self._sock.bind(bind)
        except zmq.ZMQError:  # free what we made, so the caller can report it
            if self.curve is not None:
                self.curve.stop()
            self._sock.close(linger=0)
            self._ctx.term()
            raise
        # The real endpoint: tcp://127.0.0.1:0 binds an ephemeral port that workers need to know.
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_send_failures = 0

    async def recv(self) -> list[bytes]:
        """The next multipart message: ``[identity, frame]`` from a well-behaved worker."""
        return await self._sock.recv_multipart()

    def send(self, worker_id: str, frame: bytes) -> bool:
        """Hand ``frame`` to ``worker_id``'s link now; False (counted and logged) if it cannot go."""
        if self._sock.closed:
            return False
        # DONTWAIT: pyzmq tries the send at once and hands back a finished future; nothing is awaited.
        future = self._sock.send_multipart([worker_id.encode(), frame], flags=zmq.DONTWAIT)
        error = future.exception() if isinstance(future, asyncio.Future) and future.done() else None
        if error is not None:
            self.num_send_failures += 1
            log.warning("could not send to worker %s: %s", worker_id, error)
            return False
        return True

    def close(self) -> None:
        """Free the socket (after at most LINGER_MS flushing what is queued) and its context."""
        if self.curve is not None:
            self.curve.stop()
        self._sock.close(linger=LINGER_MS)
        self._ctx.term()
