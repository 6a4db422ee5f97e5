"""The worker daemon as a real process, with this test playing the gateway on a real ROUTER socket.

One worker (the embedded SmolLM2, bf16) serves most tests in turn, each leaving it idle; the drain
test gets its own worker because it ends the process. Every wait is a poll with a deadline.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import zmq

from wire.block_hash import hash_blocks
from wire.codec import MAX_FRAME_BYTES, Decoder, encode, worker_message_decoder
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
    Shutdown,
    Submit,
    TokenBatch,
    TokenDelta,
    WorkerMessage,
)
from wire.sampling import SamplingParams
from wire.tier import DEFAULT_TIERS
from worker.config import EngineConfig
from worker.cpu_isa import read_cpuinfo
from worker.daemon import monotonic_arrival
from worker.engine import Engine
from worker.models.store import DEFAULT_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.isa]

HEARTBEAT_S = 0.2
START_TIMEOUT_S = 90.0  # model load on a busy 2-core box
TIMEOUT_S = 30.0
LONG_PROMPT = list(range(1000, 2500))  # 1,500 tokens: one prefill step of about a second on 2 cores


@dataclass
class Gateway:
    """A ROUTER socket and one worker process dialling it; ``log`` holds everything received."""

    sock: zmq.Socket[bytes]
    process: subprocess.Popen[bytes]
    worker_id: str
    stderr_path: Path
    log: list[WorkerMessage] = field(default_factory=list)
    decoder: Decoder[WorkerMessage] = field(default_factory=worker_message_decoder)

    def send(self, message: GatewayMessage) -> None:
        self.send_raw(encode(message))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart([self.worker_id.encode(), *frames])

    def recv_until(
        self, predicate: Callable[[WorkerMessage], bool], timeout_s: float = TIMEOUT_S
    ) -> WorkerMessage:
        """Receive (logging everything) until a message satisfies ``predicate``; fail at the deadline."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.process.poll() is not None:
                pytest.fail(f"worker exited with {self.process.returncode}: {self.stderr_tail()}")
            if not self.sock.poll(int(min(left, 0.5) * 1000)):
                continue
            identity, frame = self.sock.recv_multipart()
            assert identity == self.worker_id.encode()
            message = self.decoder.decode(frame)
            assert message is not None, "the worker sent a frame the gateway cannot decode"
            self.log.append(message)
            if predicate(message):
                return message
        pytest.fail(f"no matching message within {timeout_s} s; worker log: {self.stderr_tail()}")

    def collect(self, request_ids: set[str], timeout_s: float = TIMEOUT_S) -> dict[str, list[TokenDelta]]:
        """Every delta of ``request_ids`` (in the log already, then arriving) until each has finished."""
        deltas: dict[str, list[TokenDelta]] = {r: [] for r in request_ids}
        finished: set[str] = set()

        def take(message: WorkerMessage) -> bool:
            if isinstance(message, Rejected) and message.request_id in request_ids:
                pytest.fail(f"unexpected {message}")
            if isinstance(message, TokenBatch):
                for delta in message.deltas:
                    if delta.request_id in request_ids:
                        deltas[delta.request_id].append(delta)
                        if delta.finish_reason is not None:
                            finished.add(delta.request_id)
            return finished == request_ids

        if not any(take(m) for m in list(self.log)):  # deltas that arrived before this call count too
            self.recv_until(take, timeout_s)
        return deltas

    def stderr_tail(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:]


def submit(request_id: str, prompt: list[int], *, epoch: int = 1, **sampling: object) -> Submit:
    params = {"max_tokens": 8, "temperature": 0.0, **sampling}
    return Submit(
        request_id=request_id,
        epoch=epoch,
        prompt_token_ids=prompt,
        sampling=msgspec.convert(params, SamplingParams),
        tier=DEFAULT_TIERS[0],
        arrival_time=time.time(),
    )


def token_ids(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


@contextlib.contextmanager
def running_worker(tmp_path: Path, worker_id: str) -> Iterator[Gateway]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker reconnecting under its identity replaces itself
    sock.bind("tcp://127.0.0.1:0")
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    stderr_path = tmp_path / f"{worker_id}.log"
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(
            [
                *(
                    sys.executable,
                    "-m",
                    "worker.cli",
                    "worker",
                    "--connect",
                    address,
                    "--worker-id",
                    worker_id,
                ),
                *("--heartbeat-interval", str(HEARTBEAT_S), "--kv-cache-gb", "0.25", "-v"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    gateway = Gateway(sock, process, worker_id, stderr_path)
    try:
        yield gateway
    finally:
        if process.poll() is None:
            process.kill()  # never leave an orphan, whatever the test did
        process.wait(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_worker(tmp_path_factory.mktemp("daemon"), "worker-a") as gateway:
        yield gateway


@pytest.fixture(scope="module")
def register(gateway: Gateway) -> Register:
    message = gateway.recv_until(lambda m: isinstance(m, Register), START_TIMEOUT_S)
    assert isinstance(message, Register)
    return message


@pytest.fixture
def worker(gateway: Gateway, register: Register) -> Gateway:
    """The shared worker, registered, with an empty log for this test."""
    gateway.log.clear()
    return gateway


def test_register_has_sane_fields(register: Register, gateway: Gateway) -> None:
    assert register.worker_id == "worker-a"
    assert register.model == DEFAULT_MODEL
    # dtype "auto" (the worker's default) with the default model, its Q4_1 GGUF: quantized linears
    # compute in float32 on CPU
    assert (register.dtype, register.device) == ("float32", "cpu")  # --device auto, on this CPU box
    assert (register.device_name, register.device_memory_bytes) == (read_cpuinfo()[0], None)
    assert register.pid == gateway.process.pid
    assert register.block_size == 16
    assert register.num_kv_blocks > 0
    assert register.kv_capacity_tokens == register.num_kv_blocks * register.block_size
    assert register.max_model_len == 8192
    assert register.vocab_size == 49152


def test_greedy_tokens_equal_in_process_generate(worker: Gateway) -> None:
    engine = Engine.from_config(EngineConfig(kv_cache_gb=0.25))
    prompt = engine.apply_chat_template([{"role": "user", "content": "Name three primary colours."}])
    params = SamplingParams(max_tokens=24, temperature=0.0)
    expected = engine.generate([prompt], params)[0]

    worker.send(submit("greedy", prompt, max_tokens=24))
    deltas = worker.collect({"greedy"})["greedy"]
    assert token_ids(deltas) == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text
    assert deltas[-1].finish_reason == expected.finish_reason.value
    usage = deltas[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(expected.token_ids))
    assert all(d.epoch == 1 for d in deltas)

    # Failover continuation: the first 10 tokens are already with the client; the worker computes
    # them as the output rows they were and emits only what follows (the tail of the first run, to
    # the token), counting them as completion tokens.
    resumed = expected.token_ids[:10]
    worker.log.clear()
    worker.send(
        msgspec.structs.replace(submit("greedy", prompt, max_tokens=24, epoch=2), resumed_token_ids=resumed)
    )
    deltas = worker.collect({"greedy"})["greedy"]
    assert all(d.epoch == 2 for d in deltas)
    assert token_ids(deltas) == expected.token_ids[10:]
    assert "".join(d.text for d in deltas) == expected.text[len(engine.tokenizer.decode(resumed)) :]
    usage = deltas[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(expected.token_ids))


def test_heartbeats_keep_coming_during_a_long_prefill(worker: Gateway) -> None:
    worker.send(submit("long", LONG_PROMPT, max_tokens=2))
    first = worker.recv_until(lambda m: isinstance(m, TokenBatch))
    worker.collect({"long"})
    beats = [m for m in worker.log[: worker.log.index(first)] if isinstance(m, Heartbeat)]
    # A heartbeat carries the loop's snapshot from before its step: those that report the request queued
    # were sent while the engine thread was inside the prefill step. (The first may be stale: sent after
    # the last test's final step, before that step's snapshot replaced its predecessor.)
    during = [b for b in beats if b.stats.num_waiting == 1]
    assert len(during) >= 2, [b.stats for b in beats]
    assert len({b.stats.num_steps for b in during}) == 1, [b.stats for b in during]
    # During the prefill step the engine holds the main thread; heartbeats still leave on time
    # (sent_at: the worker's clock, so gateway-side polling delays do not count).
    gaps = [b.sent_at - a.sent_at for a, b in itertools.pairwise(during)]
    assert max(gaps) < 3 * HEARTBEAT_S, gaps
    assert [b.seq for b in beats] == sorted(b.seq for b in beats)


def test_concurrent_submits_share_token_batches(worker: Gateway) -> None:
    ids = {f"c{i}" for i in range(4)}
    for i, request_id in enumerate(sorted(ids)):
        worker.send(submit(request_id, [1, 504, 3458 + i, 28, 253], max_tokens=12, ignore_eos=True))
    deltas = worker.collect(ids)
    assert all(len(token_ids(d)) == 12 for d in deltas.values())
    batches = [m for m in worker.log if isinstance(m, TokenBatch)]
    # One message per step: a request appears at most once per batch, and steps only go forward.
    for batch in batches:
        names = [d.request_id for d in batch.deltas]
        assert len(names) == len(set(names))
    assert [b.step for b in batches] == sorted({b.step for b in batches})
    assert max(len(b.deltas) for b in batches) == len(ids)
    # Interleaved: far fewer messages than deltas.
    assert len(batches) < sum(len(d) for d in deltas.values()) // 2


def test_bad_submit_is_rejected_and_the_worker_serves_on(worker: Gateway, register: Register) -> None:
    worker.send(submit("too-long", [1, 2, 3], max_tokens=register.max_model_len, epoch=7))
    rejected = worker.recv_until(lambda m: isinstance(m, Rejected))
    assert isinstance(rejected, Rejected)
    assert (rejected.request_id, rejected.epoch, rejected.status, rejected.field) == (
        "too-long",
        7,
        400,
        "max_tokens",
    )
    assert register.vocab_size is not None
    worker.send(submit("bad-id", [register.vocab_size + 5]))
    rejected = worker.recv_until(lambda m: isinstance(m, Rejected))
    assert isinstance(rejected, Rejected) and (rejected.status, rejected.field) == (400, "prompt")

    worker.send(submit("after", [1, 2, 3], max_tokens=3, ignore_eos=True))
    assert len(token_ids(worker.collect({"after"})["after"])) == 3


def test_abort_stops_the_deltas_and_frees_the_blocks(worker: Gateway) -> None:
    worker.send(submit("victim", [1, 2, 3, 4, 5] * 20, max_tokens=400, ignore_eos=True, epoch=2))

    def deltas_of_victim() -> int:
        return sum(
            1 for m in worker.log if isinstance(m, TokenBatch) for d in m.deltas if d.request_id == "victim"
        )

    worker.recv_until(lambda m: deltas_of_victim() >= 3)
    worker.send(Abort(request_id="victim", epoch=1))  # a stale epoch: must not abort epoch 2
    seen = deltas_of_victim()
    worker.recv_until(lambda m: deltas_of_victim() >= seen + 3)

    worker.send(Abort(request_id="victim", epoch=2))
    idle = worker.recv_until(
        lambda m: (
            isinstance(m, Heartbeat)
            and m.stats.num_running + m.stats.num_waiting == 0
            and m.stats.num_free_blocks == m.stats.num_total_blocks
        )
    )
    # Nothing more for the victim after that heartbeat: the worker sends in order, so a request run
    # after the abort and finished proves no victim delta was still coming.
    worker.send(submit("after-abort", [1, 2, 3], max_tokens=2, ignore_eos=True))
    worker.collect({"after-abort"})
    after = worker.log[worker.log.index(idle) :]
    assert not [d for m in after if isinstance(m, TokenBatch) for d in m.deltas if d.request_id == "victim"]
    finishes = [
        d for m in worker.log if isinstance(m, TokenBatch) for d in m.deltas if d.request_id == "victim"
    ]
    assert all(d.finish_reason is None for d in finishes)  # aborted, not finished: no final delta
    assert deltas_of_victim() < 400


def test_bad_frames_are_dropped_and_the_worker_serves_on(worker: Gateway) -> None:
    worker.send_raw(b"\xc1 not msgpack at all")
    worker.send_raw(msgspec.msgpack.encode({"type": "no-such-message", "v": 1}))
    worker.send_raw(msgspec.msgpack.encode({"type": "abort", "v": 99, "request_id": "x", "epoch": 1}))
    worker.send_raw(b"", encode(Abort(request_id="x", epoch=1)))  # two frames: not our protocol
    worker.send(submit("after-garbage", [1, 2, 3], max_tokens=2, ignore_eos=True))
    worker.collect({"after-garbage"})

    # Oversize: libzmq (MAXMSGSIZE) drops the connection; the worker reconnects and registers again.
    worker.send_raw(b"\x00" * (MAX_FRAME_BYTES + 1))
    worker.recv_until(lambda m: isinstance(m, Register))
    worker.send(submit("after-oversize", [1, 2, 3], max_tokens=2, ignore_eos=True))
    worker.collect({"after-oversize"})
    assert worker.process.poll() is None
    assert "dropped malformed frame" in worker.stderr_tail()


def test_sigterm_drains_in_flight_requests_then_exits_zero(tmp_path: Path) -> None:
    with running_worker(tmp_path, "worker-drain") as gateway:
        gateway.recv_until(lambda m: isinstance(m, Register), START_TIMEOUT_S)
        ids = {"d1", "d2"}
        for request_id in sorted(ids):
            gateway.send(submit(request_id, [1, 504, 3458, 28], max_tokens=60, ignore_eos=True))
        gateway.recv_until(lambda m: isinstance(m, TokenBatch))
        gateway.process.send_signal(signal.SIGTERM)
        notice = gateway.recv_until(lambda m: isinstance(m, DrainNotice))
        assert isinstance(notice, DrainNotice) and notice.worker_id == "worker-drain"
        gateway.send(submit("late", [1, 2, 3]))
        deltas = gateway.collect(ids)
        summary = {r: (len(token_ids(d)), d[-1].finish_reason) for r, d in deltas.items()}
        assert summary == {r: (60, "length") for r in ids}
        rejected = [m for m in gateway.log if isinstance(m, Rejected)]
        if not rejected:  # the Submit may be handled after the last step: its Rejected comes later
            rejected = [gateway.recv_until(lambda m: isinstance(m, Rejected))]  # type: ignore[list-item]
        assert [(r.request_id, r.status) for r in rejected] == [("late", 503)]
        assert gateway.process.wait(timeout=TIMEOUT_S) == 0


@pytest.mark.parametrize("how", ["shutdown", "sigint"])
def test_stop_without_drain_aborts_in_flight_requests(tmp_path: Path, how: str) -> None:
    with running_worker(tmp_path, f"worker-{how}") as gateway:
        gateway.recv_until(lambda m: isinstance(m, Register), START_TIMEOUT_S)
        gateway.send(submit("doomed", [1, 504, 3458, 28], max_tokens=2000, ignore_eos=True, epoch=3))
        gateway.recv_until(lambda m: isinstance(m, TokenBatch))
        if how == "sigint":
            gateway.process.send_signal(signal.SIGINT)
        else:
            gateway.send(Shutdown(drain=False))
        deltas = gateway.collect({"doomed"})["doomed"]
        assert (deltas[-1].finish_reason, deltas[-1].epoch) == ("abort", 3)
        assert len(token_ids(deltas)) < 2000
        assert deltas[-1].usage.completion_tokens == len(token_ids(deltas))
        assert gateway.process.wait(timeout=TIMEOUT_S) == 0


def test_prefix_cache_changes_go_out_as_numbered_kv_events_and_resync_answers_with_a_snapshot(
    worker: Gateway,
) -> None:
    """The gateway's routing index is built from these: every stored block's salted hash arrives in
    KVEvents numbered one by one, heartbeats name the last number, and ResyncKV brings a KVSnapshot
    of everything cached as of that number."""
    prompt = list(range(1000, 1040))  # two full blocks of 16, and a partial one
    request = msgspec.structs.replace(submit("kv-events", prompt, max_tokens=4), cache_salt="tenant-x")
    worker.send(request)
    worker.collect({"kv-events"})
    wanted = set(hash_blocks(prompt, 16, "tenant-x")[:2])

    def stored_so_far() -> set[bytes]:
        return {h for m in worker.log if isinstance(m, KVEvents) for h in m.stored}

    if not wanted <= stored_so_far():
        worker.recv_until(lambda m: isinstance(m, KVEvents) and wanted <= stored_so_far())
    numbers = [m.seq for m in worker.log if isinstance(m, KVEvents)]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # no gaps
    last = numbers[-1]
    beat = worker.recv_until(lambda m: isinstance(m, Heartbeat) and m.stats.kv_events_seq >= last)
    assert isinstance(beat, Heartbeat) and beat.stats.kv_events_seq == last

    worker.send(ResyncKV())
    snapshot = worker.recv_until(lambda m: isinstance(m, KVSnapshot))
    assert isinstance(snapshot, KVSnapshot)
    assert (snapshot.seq, snapshot.part, snapshot.num_parts, snapshot.block_size) == (last, 0, 1, 16)
    assert wanted <= set(snapshot.hashes)
    assert not set(hash_blocks(prompt, 16, "tenant-y")) & set(snapshot.hashes)  # salted per tenant


def test_a_gateway_arrival_lands_on_the_monotonic_clock_never_in_the_future() -> None:
    before = time.monotonic()
    assert before - 3.0 - 0.5 < monotonic_arrival(time.time() - 3.0) <= time.monotonic() - 3.0
    assert before <= monotonic_arrival(time.time() + 60.0) <= time.monotonic()  # a clock ahead of ours
