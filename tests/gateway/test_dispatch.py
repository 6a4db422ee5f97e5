"""The dispatcher against real mock workers (tests/gateway/mock_fleet.py): streams, spreading, rejects,
cancellation, garbage frames, the arrival time a Submit carries (each worker message's handler without
sockets: test_worker_messages.py; the in-flight table's state machine: test_in_flight_table.py;
failover: test_dispatch_failover.py). Every wait is bounded, and waits on an event (a delta, a heartbeat, a
counter), never on a sleep.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import msgspec
import pytest
import zmq

from gateway.dispatch import Dispatcher, NoWorkerAvailable, WorkerRejected
from tests.gateway.mock_fleet import (
    MODEL,
    TIER,
    WORKER_IDS,
    Fleet,
    collect,
    greedy,
    prompt_ids,
    run,
    token_ids,
    worker_info,
)
from wire.codec import encode
from wire.messages import Heartbeat, Register, TokenBatch, TokenDelta, Usage, WorkerStats
from worker.mock import MockModel

pytestmark = pytest.mark.timeout(90)


def test_one_request_streams_the_mock_transcript(fleet: Fleet) -> None:
    prompt = prompt_ids("Hello, tierserve!")

    async def scenario(dispatcher: Dispatcher) -> None:
        stream = await dispatcher.submit(MODEL, "r-one", prompt, greedy(40), TIER)
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
    prompts = {f"r-{i}": prompt_ids(f"request number {i}") for i in range(16)}

    async def one(dispatcher: Dispatcher, request_id: str) -> str:
        stream = await dispatcher.submit(MODEL, request_id, prompts[request_id], greedy(24), TIER)
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
        stream = await dispatcher.submit(MODEL, "r-long", prompt_ids("hi"), greedy(5000), TIER)
        with pytest.raises(WorkerRejected) as caught:
            await collect(stream)
        assert caught.value.field == "max_tokens"
        assert caught.value.status == 400
        assert "4096" in caught.value.message
        assert dispatcher.stats().num_in_flight == 0
        with pytest.raises(NoWorkerAvailable):
            await dispatcher.submit("no-such-model", "r-none", prompt_ids("hi"), greedy(4), TIER)

    run(fleet, scenario)


def test_cancelling_the_consumer_aborts_and_frees_the_blocks(fleet: Fleet) -> None:
    async def scenario(dispatcher: Dispatcher) -> None:
        stream = await dispatcher.submit(MODEL, "r-cancel", prompt_ids("a long story"), greedy(4000), TIER)
        first = asyncio.get_running_loop().create_future()

        async def consume() -> None:
            async for delta in stream:
                if not first.done():
                    first.set_result(delta)

        consumer = asyncio.create_task(consume())
        await first
        worker = worker_info(dispatcher, stream.worker_id)
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
    prompt = prompt_ids("still serving")
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
        stream = await dispatcher.submit(MODEL, "r-after-garbage", prompt, greedy(200), TIER)
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


def test_the_submit_carries_the_clients_arrival_time(fleet: Fleet) -> None:
    # The worker's TTFT deadlines count from it: time queued in the gateway is the client's too.
    arrived = time.time() - 2.5

    async def scenario(dispatcher: Dispatcher) -> None:
        prompt = prompt_ids("hi")
        stream = await dispatcher.submit(MODEL, "r-arrived", prompt, greedy(4), TIER, arrival_time=arrived)
        assert stream._request.submit.arrival_time == arrived
        await collect(stream)
        now = await dispatcher.submit(MODEL, "r-now", prompt_ids("hi"), greedy(4), TIER)
        assert abs(now._request.submit.arrival_time - time.time()) < 5
        await collect(now)

    run(fleet, scenario)
