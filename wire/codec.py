"""Frames ⇄ messages: msgpack via msgspec, never pickle.

The two sides fail differently on purpose. A bad frame *received* is someone else's problem (a peer
of another version, a fuzzer, a bug elsewhere): :meth:`Decoder.decode` counts it, logs a sample and
returns ``None``, so one bad frame never kills a socket loop. A frame we are about to *send* that
breaks the size cap is our bug: :func:`encode` raises at the sender, where the stack trace points
at the culprit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from wire.log_every import is_logged
from wire.messages import PROTOCOL_VERSION, GatewayMessage, Message, WorkerMessage

logger = logging.getLogger(__name__)

# Sockets set zmq.MAXMSGSIZE to this too, so libzmq drops oversize frames before we ever see them.
MAX_FRAME_BYTES = 64 * 1024 * 1024

# Log the first bad frame, then one in this many: a flood of garbage must not become a flood of logs.
LOG_EVERY_N_DROPS = 1000

M = TypeVar("M")

_encoder = msgspec.msgpack.Encoder()

# RecursionError: msgspec's answer to nesting deeper than the interpreter's recursion limit, which a
# crafted frame reaches in a few hundred bytes (as an unknown field's value, skipped recursively).
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


class _Envelope(msgspec.Struct):
    """Only the version, read from a frame that failed to decode, to tell "another version" from
    "garbage". Unknown fields (every other key) are ignored here, unlike in the real messages."""

    v: int | None = None


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def encode(message: Message, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Encode one message; ``ValueError`` if the frame would exceed ``max_frame_bytes``.

    The Structs' ``Meta`` caps are not checked here (msgspec checks them on decode only); staying
    inside them is the builder's job, with the ``MAX_*`` constants in ``wire.messages``.
    """
    frame = _encoder.encode(message)
    if len(frame) > max_frame_bytes:
        raise ValueError(
            f"{type(message).__name__} encodes to {len(frame)} bytes, over the {max_frame_bytes}-byte "
            "frame limit: split it (TokenBatch) or cap it before sending (Submit)"
        )
    return frame


@dataclass(slots=True)
class DecodeStats:
    """Counters of one Decoder; ``decoded`` counts frames returned as messages."""

    decoded: int = 0
    dropped_oversize: int = 0
    dropped_malformed: int = 0  # not msgpack, unknown tag, wrong type, unknown field, over a Meta cap
    dropped_version: int = 0

    @property
    def num_dropped(self) -> int:
        return self.dropped_oversize + self.dropped_malformed + self.dropped_version


class Decoder(Generic[M]):
    """Decodes the frames of one direction: ``Decoder[WorkerMessage]`` in the gateway,
    ``Decoder[GatewayMessage]`` in a worker (see :func:`worker_message_decoder`).

    Not thread-safe in its counters; each socket loop owns its own Decoder.
    """

    __slots__ = ("_decoder", "_name", "max_frame_bytes", "stats")

    def __init__(self, message_type: Any, *, max_frame_bytes: int = MAX_FRAME_BYTES, name: str = "") -> None:
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(message_type)
        self._name = name or str(message_type)
        self.max_frame_bytes = max_frame_bytes
        self.stats = DecodeStats()

    def decode(self, frame: bytes | bytearray | memoryview) -> M | None:
        """The message in ``frame``, or ``None`` (counted, sampled in the log) if it is not one."""
        if len(frame) > self.max_frame_bytes:
            self.stats.dropped_oversize += 1
            self._log_drop(f"oversize frame of {len(frame)} bytes (limit {self.max_frame_bytes})")
            return None
        try:
            message = self._decoder.decode(frame)
        except _DECODE_ERRORS as exc:
            version = _peek_version(frame)
            if version is not None and version != PROTOCOL_VERSION:
                self._drop_version(version)
            else:
                self.stats.dropped_malformed += 1
                # repr and a cap: the error can quote a peer's bytes (a field name), which must not
                # forge log lines or flood them.
                self._log_drop(f"malformed frame of {len(frame)} bytes: {str(exc)[:200]!r}")
            return None
        if message.v != PROTOCOL_VERSION:
            self._drop_version(message.v)
            return None
        self.stats.decoded += 1
        return message

    def _drop_version(self, version: int) -> None:
        self.stats.dropped_version += 1
        self._log_drop(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")

    def _log_drop(self, reason: str) -> None:
        num_dropped = self.stats.num_dropped
        if is_logged(num_dropped, LOG_EVERY_N_DROPS):
            s = self.stats
            logger.warning(
                "%s decoder dropped %s (dropped so far: %d oversize, %d malformed, %d version; "
                "logging one drop in %d)",
                self._name,
                reason,
                s.dropped_oversize,
                s.dropped_malformed,
                s.dropped_version,
                LOG_EVERY_N_DROPS,
            )


def _peek_version(frame: bytes | bytearray | memoryview) -> int | None:
    try:
        return _envelope_decoder.decode(frame).v
    except _DECODE_ERRORS:
        return None


def worker_message_decoder(*, max_frame_bytes: int = MAX_FRAME_BYTES) -> Decoder[WorkerMessage]:
    """What the gateway decodes: messages workers send."""
    return Decoder(WorkerMessage, max_frame_bytes=max_frame_bytes, name="worker-message")


def gateway_message_decoder(*, max_frame_bytes: int = MAX_FRAME_BYTES) -> Decoder[GatewayMessage]:
    """What a worker decodes: messages the gateway sends."""
    return Decoder(GatewayMessage, max_frame_bytes=max_frame_bytes, name="gateway-message")
