"""The dispatcher's ROUTER as a CURVE server: raw DEALERs with and without the right keys register or not.

In-process and fast; ``tests/e2e/test_curve.py`` does the same with real worker processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq

from gateway.dispatch import Dispatcher
from gateway.link_security import CurveServerKeys
from gateway.worker_link import WorkerLink, is_loopback, worker_link
from wire.codec import encode
from wire.config import GatewayConfig
from wire.curve import CurveKeyPair, load_key_pair, load_public_key, write_public_key
from wire.messages import Register

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 10.0
SERVER = CurveKeyPair(*zmq.curve_keypair())
GOOD = CurveKeyPair(*zmq.curve_keypair())
UNKNOWN = CurveKeyPair(*zmq.curve_keypair())


def register(worker_id: str) -> bytes:
    message = Register(
        worker_id=worker_id, model="m", dtype="x", device="x", num_kv_blocks=1, block_size=16,
        kv_capacity_tokens=16, max_model_len=64, max_num_seqs=4, pid=1,
    )  # fmt: skip
    return encode(message)


@pytest.fixture
async def dispatcher() -> AsyncIterator[Dispatcher]:
    keys = CurveServerKeys(SERVER, frozenset({GOOD.public_key}))
    dispatcher = Dispatcher("tcp://127.0.0.1:0", curve=keys)
    await dispatcher.start()
    try:
        yield dispatcher
    finally:
        await dispatcher.close()


def dealer(
    ctx: zmq.Context[zmq.Socket[bytes]], worker_id: str, pair: CurveKeyPair | None, server: bytes
) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt_string(zmq.IDENTITY, worker_id)
    if pair is not None:
        sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret_key)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server)
    return sock


async def logged(caplog: pytest.LogCaptureFixture, *texts: str) -> None:
    """Until a log record (from any thread: the authenticator has its own) contains one of ``texts``."""
    deadline = time.monotonic() + TIMEOUT_S
    while not any(text in record.getMessage() for record in caplog.records for text in texts):
        assert time.monotonic() < deadline, f"never logged: {texts!r}"
        await asyncio.sleep(0.02)  # the poll interval of a deadline-bounded wait


async def test_only_workers_with_an_authorized_key_get_through(
    dispatcher: Dispatcher, caplog: pytest.LogCaptureFixture
) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        socks = {
            "unknown": dealer(ctx, "unknown", UNKNOWN, SERVER.public_key),
            "plain": dealer(ctx, "plain", None, SERVER.public_key),
            "wrong-server": dealer(ctx, "wrong-server", GOOD, UNKNOWN.public_key),
            "good": dealer(ctx, "good", GOOD, SERVER.public_key),
        }
        for worker_id, sock in socks.items():
            sock.connect(dispatcher.address)
            sock.send(register(worker_id), zmq.DONTWAIT)  # queued until a handshake succeeds, if one does
        await logged(caplog, f"CURVE public key {UNKNOWN.public_key.decode()} is not among the authorized")
        # The plain one: both ends see the mechanisms differ, and when the worker hangs up first
        # the gateway's libzmq can only say the connection closed.
        await logged(caplog, "handshake (mechanism mismatch", "handshake (no detail: the worker hung up")
        await logged(caplog, "failed its CURVE handshake (cryptographic")  # the one with another server's key
        await dispatcher.wait_until(lambda: dispatcher.registry.get("good") is not None, TIMEOUT_S)
        assert [w for w in socks if dispatcher.registry.get(w) is not None] == ["good"]
    finally:
        ctx.destroy(linger=0)


async def test_a_plain_dispatcher_lets_a_plain_worker_in() -> None:
    dispatcher = Dispatcher("tcp://127.0.0.1:0")
    await dispatcher.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = dealer(ctx, "plain", None, b"")
        sock.connect(dispatcher.address)
        sock.send(register("plain"))
        await dispatcher.wait_until(lambda: dispatcher.registry.get("plain") is not None, TIMEOUT_S)
    finally:
        ctx.destroy(linger=0)
        await dispatcher.close()


def test_serve_gives_its_own_workers_throwaway_keys_it_authorizes(tmp_path: Path) -> None:
    secret = tmp_path / "gateway.key_secret"
    public, secret_key = (key.decode() for key in (SERVER.public_key, SERVER.secret_key))
    secret.write_text(f'curve\n    public-key = "{public}"\n    secret-key = "{secret_key}"\n')
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    write_public_key(authorized / "good.key", GOOD.public_key)
    config = GatewayConfig(curve_secret_key_file=str(secret), curve_authorized_keys_dir=str(authorized))
    with worker_link(config, own_workers=True) as link:
        assert link.curve is not None
        flags = dict(zip(link.worker_args[::2], link.worker_args[1::2], strict=True))
        own = load_key_pair(flags["--curve-secret-key-file"])
        assert load_public_key(flags["--curve-server-key-file"]) == SERVER.public_key
        assert link.curve.authorized_keys == {GOOD.public_key, own.public_key}
        folder = Path(flags["--curve-secret-key-file"]).parent
        assert folder.stat().st_mode & 0o077 == 0  # private to this user
    assert not folder.exists()  # gone with the run
    with worker_link(config, own_workers=False) as link:
        assert link.worker_args == [] and link.curve is not None
        assert link.curve.authorized_keys == {GOOD.public_key}  # only what the config lists
    with worker_link(GatewayConfig(), own_workers=True) as link:
        assert (link.curve, link.worker_args) == (None, [])


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:0", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///run/tierserve/workers", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.0.0.7:5555", False),
    ],
)
def test_exposed_plain_links_are_warned_about(address: str, loopback: bool) -> None:
    assert is_loopback(address) == loopback
    warning = WorkerLink(address, None).exposure_warning
    assert (warning is None) == loopback
    keys = CurveServerKeys(SERVER, frozenset({GOOD.public_key}))
    assert WorkerLink(address, keys).exposure_warning is None  # CURVE: fine anywhere
