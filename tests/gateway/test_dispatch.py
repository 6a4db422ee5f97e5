"""The dispatcher against real mock workers: two ``tierserve worker --mock`` processes dial its ROUTER.

The workers live for the whole module; each test runs its own Dispatcher (its own event loop, via
``asyncio.run``) on the same port, and the workers' DEALERs reconnect and re-Register by themselves.
Every wait is bounded, and waits on an event (a delta, a heartbeat, a counter), never on a sleep.
At the end, without workers: the handler table (the in-flight table's state machine:
test_in_flight_table.py).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, get_args

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.dispatch import Dispatcher, NoWorkerAvailable, RequestStream, WorkerLost, WorkerRejected
from gateway.workers import WorkerInfo, WorkerState
from policies.routing import RouteRequest, RoutingPolicy, WorkerView
from wire.byte_tokenizer import BYTE_OFFSET
from wire.codec import encode, gateway_message_decoder
from wire.messages import (
    Abort,
    GatewayMessage,
    Heartbeat,
    Register,
    ResyncKV,
    Submit,
    TokenBatch,
    TokenDelta,
    Usage,
    WorkerMessage,
    WorkerStats,
)
from wire.sampling import SamplingParams
from wire.tier import DEFAULT_TIERS
from worker.detokenizer import IncrementalDetokenizer
from worker.mock import VOCAB_SIZE, MockModel, MockTokenizer

MODEL = "mock"
WORKER_IDS = ("w1", "w2")
HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 1.5
START_TIMEOUT_S = 30.0  # two workers importing torch at once on a 2-core box
TEST_TIMEOUT_S = 20.0
TIER = DEFAULT_TIERS[0]

pytestmark = pytest.mark.timeout(90)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def _prompt(text: str) -> list[int]:
    return MockTokenizer().encode(text)


@dataclass
class Fleet:
    """Mock worker processes dialling ``address``; a killed one is restarted by :meth:`ensure_alive`."""

    address: str
    log_dir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def spawn(self, worker_id: str) -> None:
        stderr = (self.log_dir / f"{worker_id}.log").open("ab")
        self.processes[worker_id] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker.cli",
                "worker",
                "--mock",
                "--mock-step-ms",
                "2",
                "--heartbeat-interval",
                str(HEARTBEAT_INTERVAL_S),
                "--connect",
                self.address,
                "--worker-id",
                worker_id,
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        stderr.close()

    def ensure_alive(self) -> None:
        for worker_id in WORKER_IDS:
            process = self.processes.get(worker_id)
            if process is None or process.poll() is not None:
                self.spawn(worker_id)

    def kill(self, worker_id: str) -> None:
        process = self.processes[worker_id]
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        for process in self.processes.values():
            process.wait(10)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # Bind port 0 once to learn a free port (and check LAST_ENDPOINT reads it back); each test binds it again.
    probe = Dispatcher("tcp://127.0.0.1:0")
    address = probe.address
    asyncio.run(probe.close())
    assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":0")
    fleet = Fleet(address, tmp_path_factory.mktemp("workers"))
    try:
        fleet.ensure_alive()
        yield fleet
    finally:
        fleet.close()


def run(
    fleet: Fleet,
    scenario: Callable[[Dispatcher], Awaitable[None]],
    *,
    max_migrations: int = 2,
    hang_timeout_s: float = 30.0,
    routing: RoutingPolicy | None = None,
) -> None:
    """Run ``scenario`` against a started Dispatcher that both workers have registered with."""
    fleet.ensure_alive()

    async def main() -> None:
        dispatcher = Dispatcher(
            fleet.address,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            hang_timeout_s=hang_timeout_s,
            max_migrations=max_migrations,
            routing=routing,
        )
        await dispatcher.start()
        try:
            await dispatcher.wait_for_workers(MODEL, len(WORKER_IDS), START_TIMEOUT_S)
            async with asyncio.timeout(TEST_TIMEOUT_S):
                await scenario(dispatcher)
        finally:
            await dispatcher.close()

    asyncio.run(main())


async def collect(stream: RequestStream) -> list[TokenDelta]:
    return [delta async for delta in stream]


def token_ids(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _worker(dispatcher: Dispatcher, worker_id: str) -> WorkerInfo:
    info = dispatcher.registry.get(worker_id)
    assert info is not None
    return info


def test_one_request_streams_the_mock_transcript(fleet: Fleet) -> None:
    prompt = _prompt("Hello, tierserve!")

    async def scenario(dispatcher: Dispatcher) -> None:
        stream = await dispatcher.submit(MODEL, "r-one", prompt, _greedy(40), TIER)
        deltas = await collect(stream)
        assert token_ids(deltas) == MockModel().transcript(prompt, 40)
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert deltas[-1].finish_reason == "length"
        assert deltas[-1].usage.completion_tokens == 40
        assert deltas[-1].usage.prompt_tokens == len(prompt)
        assert {d.epoch for d in deltas} == {0}
        assert dispatcher.stats().num_in_flight == 0

    run(fleet, scenario)


def test_concurrent_requests_complete_and_spread_over_both_workers(fleet: Fleet) -> None:
    prompts = {f"r-{i}": _prompt(f"request number {i}") for i in range(16)}

    async def one(dispatcher: Dispatcher, request_id: str) -> str:
        stream = await dispatcher.submit(MODEL, request_id, prompts[request_id], _greedy(24), TIER)
        assert token_ids(await collect(stream)) == MockModel().transcript(prompts[request_id], 24)
        return stream.worker_id

    async def scenario(dispatcher: Dispatcher) -> None:
        worker_ids = await asyncio.gather(*(one(dispatcher, rid) for rid in prompts))
        counts = Counter(worker_ids)
        assert set(counts) == set(WORKER_IDS)
        assert min(counts.values()) >= 4, counts
        assert dispatcher.stats().num_in_flight == 0

    run(fleet, scenario)


def test_max_tokens_past_the_context_is_rejected_by_the_worker(fleet: Fleet) -> None:
    async def scenario(dispatcher: Dispatcher) -> None:
        stream = await dispatcher.submit(MODEL, "r-long", _prompt("hi"), _greedy(5000), TIER)
        with pytest.raises(WorkerRejected) as caught:
            await collect(stream)
        assert caught.value.field == "max_tokens"
        assert caught.value.status == 400
        assert "4096" in caught.value.message
        assert dispatcher.stats().num_in_flight == 0
        with pytest.raises(NoWorkerAvailable):
            await dispatcher.submit("no-such-model", "r-none", _prompt("hi"), _greedy(4), TIER)

    run(fleet, scenario)


def test_cancelling_the_consumer_aborts_and_frees_the_blocks(fleet: Fleet) -> None:
    async def scenario(dispatcher: Dispatcher) -> None:
        stream = await dispatcher.submit(MODEL, "r-cancel", _prompt("a long story"), _greedy(4000), TIER)
        first = asyncio.get_running_loop().create_future()

        async def consume() -> None:
            async for delta in stream:
                if not first.done():
                    first.set_result(delta)

        consumer = asyncio.create_task(consume())
        await first
        worker = _worker(dispatcher, stream.worker_id)
        # The request visibly holds blocks before the cancel, so "all free" afterwards means something.
        await dispatcher.wait_until(lambda: worker.stats is not None and worker.stats.num_running == 1, 5.0)
        assert worker.stats is not None and worker.stats.num_free_blocks < worker.stats.num_total_blocks
        seq_at_cancel = worker.heartbeat_seq
        assert seq_at_cancel is not None
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        assert dispatcher.stats().num_in_flight == 0

        def blocks_back() -> bool:
            # Two heartbeats on: the first could carry stats read just before the Abort landed.
            stats, seq = worker.stats, worker.heartbeat_seq
            return (
                stats is not None
                and seq is not None
                and seq >= seq_at_cancel + 2
                and stats.num_running == 0
                and stats.num_free_blocks == stats.num_total_blocks
            )

        await dispatcher.wait_until(blocks_back, 5.0)

    run(fleet, scenario)


def test_garbage_frames_are_dropped_and_counted(fleet: Fleet) -> None:
    prompt = _prompt("still serving")
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.IDENTITY, b"rogue")
    rogue.setsockopt(zmq.LINGER, 0)

    def stats_frame(worker_id: str) -> bytes:
        stats = WorkerStats(
            num_running=0,
            num_waiting=0,
            num_free_blocks=1,
            num_total_blocks=1,
            step_time_ema_ms=0.0,
            num_steps=0,
            num_preemptions=0,
        )
        return encode(Heartbeat(worker_id=worker_id, seq=0, sent_at=0.0, stats=stats))

    async def scenario(dispatcher: Dispatcher) -> None:
        rogue.connect(dispatcher.address)
        rogue.send(b"\xc1 not msgpack")
        rogue.send(msgspec.msgpack.encode({"type": "heartbeat", "v": 99}))
        rogue.send_multipart([b"two", b"frames"])
        rogue.send(stats_frame("w1"))  # claims to be w1 from another connection
        rogue.send(stats_frame("rogue"))  # well-formed, but never registered
        await dispatcher.wait_until(
            lambda: (
                (s := dispatcher.stats()).num_dropped_unknown_peer >= 2
                and s.num_dropped_multipart >= 1
                and s.decode.dropped_malformed >= 1
                and s.decode.dropped_version >= 1
            ),
            5.0,
        )
        # A registered rogue may not inject tokens into a request another worker runs.
        rogue.send(
            encode(
                Register(
                    worker_id="rogue",
                    model="rogue-model",
                    dtype="x",
                    device="x",
                    num_kv_blocks=1,
                    block_size=16,
                    kv_capacity_tokens=16,
                    max_model_len=64,
                    max_num_seqs=4,
                    pid=1,
                )
            )
        )
        stream = await dispatcher.submit(MODEL, "r-after-garbage", prompt, _greedy(200), TIER)
        deltas = [await anext(stream)]
        fake = TokenDelta(
            request_id="r-after-garbage",
            epoch=0,
            token_ids=[5, 5, 5],
            usage=Usage(prompt_tokens=1, completion_tokens=3),
        )
        rogue.send(encode(TokenBatch(worker_id="rogue", step=1, deltas=[fake])))
        await dispatcher.wait_until(lambda: dispatcher.stats().num_stale_deltas >= 1, 5.0)
        deltas += await collect(stream)
        assert token_ids(deltas) == MockModel().transcript(prompt, 200)
        assert dispatcher.stats().num_workers_ready == 3  # w1, w2 and the harmless rogue

    try:
        run(fleet, scenario)
    finally:
        rogue.close()
        ctx.term()


def test_killed_worker_ends_its_streams_with_worker_lost_when_migration_is_off(fleet: Fleet) -> None:
    async def scenario(dispatcher: Dispatcher) -> None:
        stream = await dispatcher.submit(MODEL, "r-doomed", _prompt("doomed"), _greedy(3000), TIER)
        await anext(stream)
        victim = stream.worker_id
        (survivor,) = set(WORKER_IDS) - {victim}
        fleet.kill(victim)
        killed_at = time.monotonic()
        with pytest.raises(WorkerLost) as caught:
            await collect(stream)
        elapsed = time.monotonic() - killed_at
        assert caught.value.worker_id == victim
        # Silent for the timeout, noticed at the next expiry sweep (a quarter of it), plus a margin.
        assert elapsed < HEARTBEAT_TIMEOUT_S * 1.25 + 0.5, elapsed
        assert dispatcher.stats().num_workers_dead == 1
        prompts = [_prompt(f"after {i}") for i in range(4)]
        streams = [
            await dispatcher.submit(MODEL, f"r-after-{i}", prompt, _greedy(8), TIER)
            for i, prompt in enumerate(prompts)
        ]
        for prompt, s in zip(prompts, streams, strict=True):
            assert s.worker_id == survivor
            assert token_ids(await collect(s)) == MockModel().transcript(prompt, 8)
        assert dispatcher.stats().num_migrations == {}

    run(fleet, scenario, max_migrations=0)


# ---------------------------------------------------------------- migration


def _text(deltas: list[TokenDelta]) -> str:
    return "".join(d.text for d in deltas)


def _expected_text(prompt: list[int], max_tokens: int) -> str:
    return MockTokenizer().decode(MockModel().transcript(prompt, max_tokens), skip_special_tokens=True)


def test_killed_worker_s_stream_migrates_to_the_survivor_and_continues_exactly(fleet: Fleet) -> None:
    prompt = _prompt("migrate me")
    max_tokens = 600

    async def scenario(dispatcher: Dispatcher) -> None:
        stream = await dispatcher.submit(MODEL, "r-moved", prompt, _greedy(max_tokens), TIER)
        deltas = [await anext(stream)]
        victim = stream.worker_id
        (survivor,) = set(WORKER_IDS) - {victim}
        fleet.kill(victim)
        deltas += await collect(stream)
        assert token_ids(deltas) == MockModel().transcript(prompt, max_tokens)  # nothing lost or repeated
        assert _text(deltas) == _expected_text(prompt, max_tokens)
        assert [d.epoch for d in deltas] == sorted(d.epoch for d in deltas)
        assert {d.epoch for d in deltas} == {0, 1}
        assert stream.worker_id == survivor and stream.epoch == 1
        last = deltas[-1]
        assert last.finish_reason == "length"
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), max_tokens)
        stats = dispatcher.stats()
        assert stats.num_migrations == {MODEL: 1} and stats.num_workers_lost == 1
        assert stats.num_in_flight == 0

    run(fleet, scenario)


class Preferring:
    """A routing policy for tests: the first of ``order`` that is a candidate, else the first candidate."""

    kind: ClassVar[str] = "routing"

    def __init__(self, *order: str) -> None:
        self.order = list(order)

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> int:
        ids = [c.worker_id for c in candidates]
        return next((ids.index(w) for w in self.order if w in ids), 0)


class FakeWorker:
    """A worker by hand on a raw DEALER: it registers, heartbeats and sends exactly the frames a test
    says, and shows what the gateway sent it."""

    def __init__(self, address: str, worker_id: str, pid: int) -> None:
        self.worker_id = worker_id
        self.pid = pid
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._decoder = gateway_message_decoder()
        self._step = 0
        self._beater: asyncio.Task[None] | None = None
        self.num_steps = 0  # what its heartbeats report

    def start_beating(self, *, num_running: int) -> None:
        """Heartbeat every HEARTBEAT_INTERVAL_S (as a worker's socket thread does) until stopped."""

        async def beat() -> None:
            while True:
                await self.heartbeat(num_running=num_running, num_steps=self.num_steps)
                await asyncio.sleep(HEARTBEAT_INTERVAL_S)  # the fake's heartbeat period

        self._beater = asyncio.create_task(beat())

    async def stop_beating(self) -> None:
        if self._beater is not None:
            self._beater.cancel()
            await asyncio.gather(self._beater, return_exceptions=True)
            self._beater = None

    async def send(self, message: Register | Heartbeat | TokenBatch) -> None:
        await self._sock.send(encode(message))

    async def register(self) -> None:
        await self.send(
            Register(
                worker_id=self.worker_id,
                model=MODEL,
                dtype="float32",
                device="cpu",
                num_kv_blocks=512,
                block_size=16,
                kv_capacity_tokens=512 * 16,
                max_model_len=4096,
                max_num_seqs=64,
                vocab_size=VOCAB_SIZE,
                pid=self.pid,
            )
        )

    async def heartbeat(self, *, num_running: int, num_steps: int) -> None:
        stats = WorkerStats(
            num_running=num_running,
            num_waiting=0,
            num_free_blocks=500,
            num_total_blocks=512,
            step_time_ema_ms=2.0,
            num_steps=num_steps,
            num_preemptions=0,
        )
        await self.send(Heartbeat(worker_id=self.worker_id, seq=num_steps, sent_at=0.0, stats=stats))

    async def tokens(self, submit: Submit, new_ids: list[int], text: str, num_done: int) -> None:
        """One delta of ``new_ids`` for ``submit``, ``num_done`` completion tokens in all."""
        self._step += 1
        usage = Usage(prompt_tokens=len(submit.prompt_token_ids), completion_tokens=num_done)
        delta = TokenDelta(
            request_id=submit.request_id, epoch=submit.epoch, token_ids=new_ids, text=text, usage=usage
        )
        await self.send(TokenBatch(worker_id=self.worker_id, step=self._step, deltas=[delta]))

    async def receive(self) -> GatewayMessage:
        """The next message, less ResyncKV (this fake has no prefix cache to tell about)."""
        while True:
            message = self._decoder.decode(await self._sock.recv())
            assert message is not None
            if not isinstance(message, ResyncKV):
                return message

    async def close(self) -> None:
        await self.stop_beating()
        self._sock.close()
        self._ctx.term()


def _cut_inside_a_character(prompt: list[int], max_tokens: int) -> int:
    """How many transcript tokens end right after the lead byte of a multi-byte character."""
    transcript = MockModel().transcript(prompt, max_tokens)
    return next(i + 1 for i, t in enumerate(transcript) if 0xE0 <= t - BYTE_OFFSET <= 0xEF)


def _texts(prompt: list[int], token_ids: list[int]) -> str:
    """The text a worker sends for ``token_ids``, one token a step as the engine feeds its detokenizer."""
    tokenizer: Any = MockTokenizer()  # the byte tokenizer quacks like a Hugging Face one
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    return "".join(detokenizer.update([t]).text for t in token_ids)


async def _wait_ready(dispatcher: Dispatcher, *worker_ids: str) -> None:
    def ready() -> bool:
        return all((w := dispatcher.registry.get(i)) is not None and w.state is WorkerState.READY
                   for i in worker_ids)  # fmt: skip

    await dispatcher.wait_until(ready, 5.0)


def test_a_silent_worker_s_request_resumes_elsewhere_from_inside_a_character(fleet: Fleet) -> None:
    """The fake worker sends tokens that end inside a UTF-8 character, then falls silent: the request
    moves to a real worker with epoch 1 and the tokens sent so far, and the client's text continues
    exactly (the new worker's detokenizer knows the half character). The fake's late tokens are
    dropped and answered with an Abort of its epoch."""
    prompt = next(p for i in range(100) if _cut_inside_a_character(p := _prompt(f"resume {i}"), 80) < 40)
    max_tokens = 80
    cut = _cut_inside_a_character(prompt, max_tokens)
    transcript = MockModel().transcript(prompt, max_tokens)

    async def scenario(dispatcher: Dispatcher) -> None:
        fake = FakeWorker(dispatcher.address, "fake", pid=4242)
        try:
            await fake.register()
            await _wait_ready(dispatcher, "fake")
            stream = await dispatcher.submit(MODEL, "r-resume", prompt, _greedy(max_tokens), TIER)
            submit = await fake.receive()
            assert isinstance(submit, Submit) and submit.epoch == 0 and submit.resumed_token_ids == []
            sent = transcript[:cut]
            await fake.tokens(submit, sent, _texts(prompt, sent), cut)
            first = await anext(stream)
            assert first.text == _texts(prompt, sent) and not first.text.endswith("\ufffd")
            # Now silent: ejected after HEARTBEAT_TIMEOUT_S, and the request moves.
            rest = await collect(stream)
            deltas = [first, *rest]
            assert token_ids(deltas) == transcript
            assert _text(deltas) == _expected_text(prompt, max_tokens)
            assert stream.worker_id in WORKER_IDS and stream.epoch == 1
            assert (rest[-1].usage.prompt_tokens, rest[-1].usage.completion_tokens) == (
                len(prompt),
                max_tokens,
            )
            assert dispatcher.stats().num_migrations == {MODEL: 1}
            # The ejection's Abort reached the fake; a late delta of its epoch is dropped and aborted again.
            abort = await fake.receive()
            assert isinstance(abort, Abort) and (abort.request_id, abort.epoch) == ("r-resume", 0)
            stale_before = dispatcher.stats().num_stale_deltas
            await fake.tokens(submit, transcript[cut : cut + 1], "", cut + 1)
            again = await fake.receive()
            assert isinstance(again, Abort) and (again.request_id, again.epoch) == ("r-resume", 0)
            assert dispatcher.stats().num_stale_deltas == stale_before + 1
        finally:
            await fake.close()

    run(fleet, scenario, routing=Preferring("fake"))


def test_the_migration_limit_ends_the_stream_with_worker_lost(fleet: Fleet) -> None:
    """max_migrations = 1: fake A falls silent, the request moves to fake B (epoch 1, resuming after
    A's tokens); B falls silent too: the stream ends with WorkerLost naming the limit, never a hang."""
    prompt = _prompt("twice unlucky")
    transcript = MockModel().transcript(prompt, 50)

    async def scenario(dispatcher: Dispatcher) -> None:
        fake_a = FakeWorker(dispatcher.address, "fake-a", pid=1001)
        fake_b = FakeWorker(dispatcher.address, "fake-b", pid=1002)
        try:
            await fake_a.register()
            await fake_b.register()
            fake_b.start_beating(num_running=0)  # alive while fake-a falls silent
            await _wait_ready(dispatcher, "fake-a", "fake-b")
            stream = await dispatcher.submit(MODEL, "r-limit", prompt, _greedy(50), TIER)
            submit_a = await fake_a.receive()
            assert isinstance(submit_a, Submit)
            await fake_a.tokens(submit_a, transcript[:5], _texts(prompt, transcript[:5]), 5)
            assert token_ids([await anext(stream)]) == transcript[:5]
            submit_b = await fake_b.receive()  # after fake-a's silence is noticed
            assert isinstance(submit_b, Submit)
            await fake_b.stop_beating()  # now fake-b falls silent too
            assert (submit_b.epoch, submit_b.resumed_token_ids) == (1, transcript[:5])
            assert submit_b.sampling.max_tokens == 50  # the worker subtracts what was resumed
            text_b = _texts(prompt, transcript[:8]).removeprefix(_texts(prompt, transcript[:5]))
            await fake_b.tokens(submit_b, transcript[5:8], text_b, 8)
            assert token_ids([await anext(stream)]) == transcript[5:8]
            with pytest.raises(WorkerLost) as caught:
                await anext(stream)
            assert caught.value.worker_id == "fake-b" and "max_migrations" in caught.value.reason
            assert dispatcher.stats().num_migrations == {MODEL: 1}
            assert dispatcher.stats().num_in_flight == 0
        finally:
            await fake_a.close()
            await fake_b.close()

    run(fleet, scenario, max_migrations=1, routing=Preferring("fake-a", "fake-b"))


def test_a_hung_worker_that_still_heartbeats_is_ejected_and_readmitted_when_it_steps(fleet: Fleet) -> None:
    """The fake keeps heartbeating with a request running but no new step (a hung engine): ejected
    after the hang timeout and its request migrates; when its steps grow again it is READY."""
    prompt = _prompt("hung engine")
    hang_timeout_s = 1.0

    async def scenario(dispatcher: Dispatcher) -> None:
        fake = FakeWorker(dispatcher.address, "fake-hung", pid=3003)
        fake.num_steps = 10
        try:
            await fake.register()
            await _wait_ready(dispatcher, "fake-hung")
            started = time.monotonic()  # its first heartbeat with a request running is the last progress
            fake.start_beating(num_running=1)
            stream = await dispatcher.submit(MODEL, "r-hung", prompt, _greedy(60), TIER)
            submit = await fake.receive()
            assert isinstance(submit, Submit)
            deltas = await collect(stream)  # nothing from the fake: all of it from a real worker
            elapsed = time.monotonic() - started
            assert token_ids(deltas) == MockModel().transcript(prompt, 60)
            assert {d.epoch for d in deltas} == {1} and stream.worker_id in WORKER_IDS
            assert hang_timeout_s <= elapsed < hang_timeout_s * 2 + 1.0, elapsed
            info = dispatcher.registry.get("fake-hung")
            assert info is not None and info.state is WorkerState.DEAD
            assert "fake-hung" not in {w.worker_id for w in dispatcher.registry.ready(MODEL)}
            fake.num_steps += 1  # it steps again
            await dispatcher.wait_until(lambda: info.state is WorkerState.READY, 5.0)
        finally:
            await fake.close()

    run(fleet, scenario, hang_timeout_s=hang_timeout_s, routing=Preferring("fake-hung"))


# ---------------------------------------------------------------- the handler table


def test_every_worker_message_type_has_its_own_handler() -> None:
    dispatcher = Dispatcher("tcp://127.0.0.1:0")
    try:
        handlers = dispatcher._handlers
        assert set(handlers) == set(get_args(WorkerMessage))
        assert len({handler.__name__ for handler in handlers.values()}) == len(handlers)
    finally:
        asyncio.run(dispatcher.close())


def test_the_submit_carries_the_clients_arrival_time(fleet: Fleet) -> None:
    # The worker's TTFT deadlines count from it: time queued in the gateway is the client's too.
    arrived = time.time() - 2.5

    async def scenario(dispatcher: Dispatcher) -> None:
        prompt = _prompt("hi")
        stream = await dispatcher.submit(MODEL, "r-arrived", prompt, _greedy(4), TIER, arrival_time=arrived)
        assert stream._request.submit.arrival_time == arrived
        await collect(stream)
        now = await dispatcher.submit(MODEL, "r-now", _prompt("hi"), _greedy(4), TIER)
        assert abs(now._request.submit.arrival_time - time.time()) < 5
        await collect(now)

    run(fleet, scenario)
