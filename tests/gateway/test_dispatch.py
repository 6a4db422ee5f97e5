"""The dispatcher against real mock workers: two ``tierserve worker --mock`` processes dial its ROUTER.

The workers live for the whole module; each test runs its own Dispatcher (its own event loop, via
``asyncio.run``) on the same port, and the workers' DEALERs reconnect and re-Register by themselves.
Every wait is bounded, and waits on an event (a delta, a heartbeat, a counter), never on a sleep.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import zmq

from gateway.dispatch import Dispatcher, NoWorkerAvailable, RequestStream, WorkerLost, WorkerRejected
from gateway.workers import WorkerInfo
from wire.codec import encode
from wire.messages import Heartbeat, Register, TokenBatch, TokenDelta, Usage, WorkerStats
from wire.sampling import SamplingParams
from wire.tier import DEFAULT_TIERS
from worker.mock import MockModel, MockTokenizer

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


def run(fleet: Fleet, scenario: Callable[[Dispatcher], Awaitable[None]]) -> None:
    """Run ``scenario`` against a started Dispatcher that both workers have registered with."""
    fleet.ensure_alive()

    async def main() -> None:
        dispatcher = Dispatcher(fleet.address, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
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


def test_killed_worker_ends_its_streams_with_worker_lost(fleet: Fleet) -> None:
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

    run(fleet, scenario)
