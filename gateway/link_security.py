"""CURVE on the dispatcher's ROUTER: the gateway's keys, and a ZAP handler that lets in listed workers only.

    worker DEALER (CURVE client) ══ handshake ══▶ ROUTER (CURVE server, ZAP domain "tierserve-workers")
                                                     │ ZAP request (RFC 27), before any frame passes
                                                     ▼
                 zmq.auth ThreadAuthenticator ── AuthorizedKeys.callback: key listed? 200 : 400 + a log line

The authenticator runs in its own thread (pyzmq's ThreadAuthenticator), so a busy event loop never
holds up a handshake. ``ZAP_ENFORCE_DOMAIN`` makes the socket fail closed: without it libzmq lets any
client in whenever no ZAP handler answers. Handshakes that fail before ZAP is asked (a worker without
CURVE keys, or with another gateway's public key) are seen on the socket's monitor and logged too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from wire.config import GatewayConfig
from wire.curve import CurveKeyPair, load_authorized_keys, load_key_pair
from wire.log_every import is_logged

__all__ = ["AuthorizedKeys", "CurveServer", "CurveServerKeys"]

log = logging.getLogger(__name__)

ZAP_DOMAIN = b"tierserve-workers"
LOG_EVERY = 100  # a refused worker redials about once a second: log its first refusal, then every 100th
# Failures before ZAP is asked (AuthorizedKeys logs the ones it refuses itself). libzmq puts the
# reason of a PROTOCOL failure in the event's value; NO_DETAIL is a connection lost mid-handshake.
_WATCHED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_PROTOCOL_FAILURES: dict[int, str] = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "mechanism mismatch: a worker without CURVE keys?",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "cryptographic: a worker holding another gateway's public key?",
}


def handshake_failure(event: int, value: int) -> str | None:
    """Why a monitor event says a handshake failed, in words; None for other events."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "no detail: the worker hung up mid-handshake, as one without CURVE keys may"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return _PROTOCOL_FAILURES.get(value, f"protocol error {value:#x}")
    return None


@dataclass(frozen=True, slots=True)
class CurveServerKeys:
    """The gateway's key pair and the public keys of the workers it accepts (Z85)."""

    key_pair: CurveKeyPair
    authorized_keys: frozenset[bytes]

    @classmethod
    def from_config(cls, gateway: GatewayConfig) -> CurveServerKeys | None:
        """The configured keys, None with CURVE off. The config was validated on load, so a
        :class:`~wire.curve.CurveKeyError` here means a file changed since."""
        if gateway.curve_secret_key_file is None or gateway.curve_authorized_keys_dir is None:
            return None
        return cls(
            load_key_pair(gateway.curve_secret_key_file),
            load_authorized_keys(gateway.curve_authorized_keys_dir),
        )

    def authorizing(self, public_key: bytes) -> CurveServerKeys:
        """The same, letting in one more key (serve's own workers)."""
        return dataclasses.replace(self, authorized_keys=self.authorized_keys | {public_key})


class AuthorizedKeys:
    """pyzmq's CURVE credentials provider: runs in the authenticator's thread, once per handshake."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys
        self.num_refused: Counter[bytes] = Counter()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._keys:
            return True
        self.num_refused[key] += 1
        count = self.num_refused[key]
        if is_logged(count, LOG_EVERY):
            log.warning(
                "refused a worker link: CURVE public key %s is not among the authorized keys "
                "(gateway.curve_authorized_keys_dir); %d refusals of this key",
                key.decode("ascii", "replace"),
                count,
            )
        return False


class CurveServer:
    """Makes ``sock`` a CURVE server before it binds, and owns its authenticator and monitor."""

    def __init__(self, ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket, keys: CurveServerKeys) -> None:
        self.authorized = AuthorizedKeys(keys.authorized_keys)
        # Started before the socket binds: no handshake can happen without its answer.
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=self.authorized)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.key_pair.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.key_pair.secret_key)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        self._sock = sock
        self._monitor = sock.get_monitor_socket(_WATCHED_EVENTS)
        self.num_failed_handshakes: Counter[str] = Counter()

    async def watch(self) -> None:
        """Log failed handshakes (rate-limited per kind) until cancelled."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            why = handshake_failure(event["event"], event["value"])
            if why is None:
                continue
            self.num_failed_handshakes[why] += 1
            count = self.num_failed_handshakes[why]
            if is_logged(count, LOG_EVERY):
                log.warning("a worker link failed its CURVE handshake (%s); %d such failures", why, count)

    def stop(self) -> None:
        """Before the context terminates: the authenticator's and the monitor's sockets are in it."""
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._auth.stop()
