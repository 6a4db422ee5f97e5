"""A worker serving two gateways: a real mock worker process dialling two ROUTER sockets this test plays.

What each gateway must see: Register, heartbeats and KVEvents (one numbering) on both links; the tokens
and Rejecteds of a request only on the link its Submit came from; a KVSnapshot only to the gateway that
asked; an Abort or a reused request id from the other gateway touching nothing; a gateway that goes
away stalling nothing. Every wait is a poll with a deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth

from wire.codec import Decoder, encode, worker_message_decoder
from wire.curve import load_key_pair, load_public_key
from wire.messages import (
    Abort,
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
    WorkerMessage,
)
from wire.sampling import SamplingParams
from wire.tier import DEFAULT_TIERS
from worker.cli import _addresses, _curve_keys
from worker.daemon_io import CurveClientKeys
from worker.mock import MockModel

pytestmark = pytest.mark.timeout(120)

START_TIMEOUT_S = 60.0  # a worker process importing the engine on a busy 2-core box
TIMEOUT_S = 20.0
MODEL = MockModel()


@dataclass
class FakeGateway:
    """One ROUTER socket the worker dials; ``log`` holds everything received on it."""

    name: str
    sock: zmq.Socket[bytes]
    address: str
    worker_id: str = "w"
    log: list[WorkerMessage] = field(default_factory=list)
    decoder: Decoder[WorkerMessage] = field(default_factory=worker_message_decoder)

    def send(self, message: GatewayMessage) -> None:
        self.sock.send_multipart([self.worker_id.encode(), encode(message)])

    def recv_until(
        self, predicate: Callable[[WorkerMessage], bool], timeout_s: float = TIMEOUT_S
    ) -> WorkerMessage:
        """Receive (logging everything) until a message satisfies ``predicate``; fail at the deadline."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(min(left, 0.5) * 1000)):
                continue
            identity, frame = self.sock.recv_multipart()
            assert identity == self.worker_id.encode()
            message = self.decoder.decode(frame)
            assert message is not None
            self.log.append(message)
            if predicate(message):
                return message
        pytest.fail(f"gateway {self.name}: no matching message within {timeout_s} s")

    def collect(self, request_id: str) -> list[TokenDelta]:
        """Every delta of ``request_id`` (logged already, then arriving) until it finished."""
        deltas: list[TokenDelta] = []

        def take(message: WorkerMessage) -> bool:
            if isinstance(message, Rejected) and message.request_id == request_id:
                pytest.fail(f"gateway {self.name}: unexpected {message}")
            if isinstance(message, TokenBatch):
                deltas.extend(d for d in message.deltas if d.request_id == request_id)
            return bool(deltas) and deltas[-1].finish_reason is not None

        if not any(take(m) for m in list(self.log)):
            self.recv_until(take)
        return deltas

    def next_heartbeat(self) -> Heartbeat:
        """A heartbeat sent after now: the worker sends one only once the link's queue is empty, so
        whatever it had queued for this gateway before has arrived (ZeroMQ keeps a link's order)."""
        now = time.time()
        message = self.recv_until(lambda m: isinstance(m, Heartbeat) and m.sent_at > now)
        assert isinstance(message, Heartbeat)
        return message


def submit(request_id: str, prompt: list[int], max_tokens: int, *, epoch: int = 0) -> Submit:
    return Submit(
        request_id=request_id,
        epoch=epoch,
        prompt_token_ids=prompt,
        sampling=msgspec.convert(
            {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}, SamplingParams
        ),
        tier=DEFAULT_TIERS[1],
        arrival_time=time.time(),
    )


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def prompt(seed: int, n: int = 40) -> list[int]:
    return [10 + (seed * 7 + i) % 90 for i in range(n)]  # printable bytes of the mock's vocabulary


@contextlib.contextmanager
def fleet(
    tmp_path: Path, num_gateways: int = 2, extra_args: tuple[str, ...] = ()
) -> Iterator[tuple[list[FakeGateway], subprocess.Popen[bytes]]]:
    """``num_gateways`` ROUTERs and one mock worker dialling them all (its --connect in order)."""
    ctx = zmq.Context()
    gateways = []
    for i in range(num_gateways):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.bind("tcp://127.0.0.1:0")
        gateways.append(FakeGateway("AB"[i], sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)))
    stderr_path = tmp_path / "worker.log"
    command = [
        sys.executable, "-m", "worker.cli", "worker", "--mock", "--mock-step-ms", "5", "--worker-id", "w",
        "--heartbeat-interval", "0.1", "--connect", ",".join(g.address for g in gateways), "-v", *extra_args,
    ]  # fmt: skip
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        for gateway in gateways:
            gateway.recv_until(lambda m: isinstance(m, Register), START_TIMEOUT_S)
        yield gateways, process
        assert process.poll() is None, stderr_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeGateway, FakeGateway]]:
    with fleet(tmp_path_factory.mktemp("links")) as (gateways, _):
        yield gateways[0], gateways[1]


@pytest.fixture
def gateways(two: tuple[FakeGateway, FakeGateway]) -> tuple[FakeGateway, FakeGateway]:
    for gateway in two:
        gateway.log.clear()
    return two


def test_each_gateway_gets_the_tokens_of_its_own_requests_only(
    gateways: tuple[FakeGateway, FakeGateway],
) -> None:
    a, b = gateways
    a.send(submit("from-a", prompt(1), 60))
    b.send(submit("from-b", prompt(2), 60))
    assert tokens(a.collect("from-a")) == MODEL.transcript(prompt(1), 60)
    assert tokens(b.collect("from-b")) == MODEL.transcript(prompt(2), 60)
    a.next_heartbeat()
    b.next_heartbeat()
    for gateway, other in ((a, "from-b"), (b, "from-a")):
        batches = [m for m in gateway.log if isinstance(m, TokenBatch)]
        assert all(d.request_id != other for m in batches for d in m.deltas), gateway.name


def test_kv_events_reach_every_gateway_with_one_numbering(gateways: tuple[FakeGateway, FakeGateway]) -> None:
    a, b = gateways
    a.send(submit("cache-me", prompt(3, 64), 4))  # 64 prompt tokens: 4 full blocks to store
    a.collect("cache-me")
    a.next_heartbeat()
    b.next_heartbeat()  # both sent after every KVEvents of that request
    events_a = [(m.seq, m.stored, m.removed) for m in a.log if isinstance(m, KVEvents)]
    events_b = [(m.seq, m.stored, m.removed) for m in b.log if isinstance(m, KVEvents)]
    assert events_a and events_a == events_b
    assert sum(len(stored) for _, stored, _ in events_a) >= 4


def test_resync_is_answered_to_the_gateway_that_asked(gateways: tuple[FakeGateway, FakeGateway]) -> None:
    a, b = gateways
    a.send(submit("warm", prompt(4, 48), 2))
    a.collect("warm")
    last_seq = b.next_heartbeat().stats.kv_events_seq
    assert last_seq >= 0
    b.send(ResyncKV())
    snapshot = b.recv_until(lambda m: isinstance(m, KVSnapshot))
    assert isinstance(snapshot, KVSnapshot)
    assert snapshot.seq == last_seq  # the numbering both gateways follow
    assert snapshot.hashes
    a.next_heartbeat()  # anything queued for A with the snapshot would have come before this
    assert not any(isinstance(m, KVSnapshot) for m in a.log)


def test_a_request_id_of_one_gateway_is_untouchable_by_the_other(
    gateways: tuple[FakeGateway, FakeGateway],
) -> None:
    a, b = gateways
    a.send(submit("same-id", prompt(5), 150))
    a.recv_until(lambda m: isinstance(m, TokenBatch) and any(d.request_id == "same-id" for d in m.deltas))
    b.send(submit("same-id", prompt(6), 10))  # the id is only unique per gateway: refused, A's runs on
    rejected = b.recv_until(lambda m: isinstance(m, Rejected))
    assert isinstance(rejected, Rejected)
    assert (rejected.request_id, rejected.status, rejected.field) == ("same-id", 409, "request_id")
    b.send(Abort(request_id="same-id", epoch=0))  # not B's request: ignored
    b.send(submit("same-id", prompt(6), 10, epoch=1))  # nor may B supersede it with a newer epoch
    again = b.recv_until(lambda m: isinstance(m, Rejected) and m.epoch == 1)
    assert isinstance(again, Rejected) and again.status == 409
    deltas = a.collect("same-id")
    assert deltas[-1].finish_reason == "length"
    assert tokens(deltas) == MODEL.transcript(prompt(5), 150)
    b.next_heartbeat()
    assert not any(isinstance(m, TokenBatch) for m in b.log)
    b.log.clear()
    b.send(submit("same-id", prompt(6), 10))  # once A's is done, the id is free for B
    assert tokens(b.collect("same-id")) == MODEL.transcript(prompt(6), 10)


def test_a_gateway_that_goes_away_stalls_nothing(tmp_path: Path) -> None:
    with fleet(tmp_path) as ((a, b), _):
        a.send(submit("orphan", prompt(7), 400))  # still running when its gateway goes
        a.recv_until(lambda m: isinstance(m, TokenBatch))
        a.sock.close(linger=0)
        for i in range(3):
            b.send(submit(f"after-{i}", prompt(10 + i), 30))
        for i in range(3):
            assert tokens(b.collect(f"after-{i}")) == MODEL.transcript(prompt(10 + i), 30)
        first = b.next_heartbeat()
        assert b.next_heartbeat().sent_at > first.sent_at


def test_the_requests_of_a_gateway_gone_for_good_are_aborted_after_the_orphan_timeout(tmp_path: Path) -> None:
    """A dead gateway's requests would otherwise run to max_tokens for nobody: once its link has been
    down for --orphan-timeout they are dropped (their KV freed), while the other gateway's run on."""
    with fleet(tmp_path, extra_args=("--orphan-timeout", "1.0")) as ((a, b), _):
        a.send(submit("orphan", prompt(3), 4000))  # ~20 s of 5 ms steps if nobody stops it
        a.recv_until(lambda m: isinstance(m, TokenBatch))
        b.send(submit("kept", prompt(4), 4000))
        b.recv_until(lambda m: isinstance(m, TokenBatch) and any(d.request_id == "kept" for d in m.deltas))
        a.sock.close(linger=0)
        # Both would run for ~20 s more; well before that the orphan is gone and "kept" still runs.
        b.recv_until(lambda m: isinstance(m, Heartbeat) and m.stats.num_running == 1, 10.0)
        b.recv_until(lambda m: isinstance(m, TokenBatch) and any(d.request_id == "kept" for d in m.deltas))
        b.send(Abort(request_id="kept", epoch=0))
        b.recv_until(lambda m: isinstance(m, Heartbeat) and m.stats.num_running == 0, 10.0)


# ---- the command line -------------------------------------------------------------------------


def test_connect_may_be_repeated_or_comma_separated() -> None:
    assert _addresses(["tcp://a:1", "tcp://b:2,ipc:///tmp/c"]) == ["tcp://a:1", "tcp://b:2", "ipc:///tmp/c"]
    with pytest.raises(ValueError, match="given twice"):
        _addresses(["tcp://a:1", "tcp://a:1"])
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT or ipc://PATH"):
        _addresses(["a:1"])


def test_curve_flags(tmp_path: Path) -> None:
    zmq.auth.create_certificates(tmp_path, "worker")
    zmq.auth.create_certificates(tmp_path, "gw-a")
    zmq.auth.create_certificates(tmp_path, "gw-b")

    def keys(secret: str | None, *servers: str, links: int = 2) -> CurveClientKeys | None:
        args = argparse.Namespace(
            curve_secret_key_file=secret and str(tmp_path / secret),
            curve_server_key_file=[str(tmp_path / s) for s in servers],
        )
        return _curve_keys(args, links)

    assert keys(None) is None
    pair = load_key_pair(tmp_path / "worker.key_secret")
    a, b = load_public_key(tmp_path / "gw-a.key"), load_public_key(tmp_path / "gw-b.key")
    one = keys("worker.key_secret", "gw-a.key")
    assert one == CurveClientKeys(pair, (a, a))  # one file: every gateway's key
    assert keys("worker.key_secret", "gw-a.key", "gw-b.key") == CurveClientKeys(pair, (a, b))
    with pytest.raises(ValueError, match="once per --connect"):
        keys("worker.key_secret", "gw-a.key", "gw-b.key", links=3)
    with pytest.raises(ValueError, match="needs --curve-secret-key-file"):
        keys(None, "gw-a.key")
    with pytest.raises(ValueError, match="needs --curve-server-key-file"):
        keys("worker.key_secret")
    with pytest.raises(ValueError, match=r"--curve-secret-key-file: .*no secret-key"):
        keys("worker.key", "gw-a.key")
    with pytest.raises(ValueError, match=r"--curve-server-key-file: .*no such file"):
        keys("worker.key_secret", "gone.key")
