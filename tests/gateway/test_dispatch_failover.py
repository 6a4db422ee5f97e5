"""Failover against real mock workers (tests/gateway/mock_fleet.py) and workers by hand on a raw
DEALER (:class:`FakeWorker`): a killed worker's streams end or migrate and continue exactly, a silent
one's request resumes elsewhere from inside a character, the migration limit, a hung worker that still
heartbeats. Every wait is bounded, and waits on an event, never on a sleep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
import zmq
import zmq.asyncio

from gateway.dispatch import Dispatcher, WorkerLost
from gateway.logprobs import merge_prompt_logprobs
from gateway.workers import WorkerState
from policies.routing import RouteRequest, WorkerView
from tests.gateway.mock_fleet import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    MODEL,
    TIER,
    WORKER_IDS,
    Fleet,
    collect,
    greedy,
    prompt_ids,
    run,
    token_ids,
)
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
    TokenLogprob,
    Usage,
    WorkerStats,
)
from wire.sampling import SamplingParams
from worker.detokenizer import IncrementalDetokenizer
from worker.mock import VOCAB_SIZE, MockModel, MockTokenizer

pytestmark = pytest.mark.timeout(90)


def test_killed_worker_ends_its_streams_with_worker_lost_when_migration_is_off(fleet: Fleet) -> None:
    async def scenario(dispatcher: Dispatcher) -> None:
        stream = await dispatcher.submit(MODEL, "r-doomed", prompt_ids("doomed"), greedy(3000), TIER)
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
        prompts = [prompt_ids(f"after {i}") for i in range(4)]
        streams = [
            await dispatcher.submit(MODEL, f"r-after-{i}", prompt, greedy(8), TIER)
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
    prompt = prompt_ids("migrate me")
    max_tokens = 600

    async def scenario(dispatcher: Dispatcher) -> None:
        stream = await dispatcher.submit(MODEL, "r-moved", prompt, greedy(max_tokens), TIER)
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
    prompt = next(p for i in range(100) if _cut_inside_a_character(p := prompt_ids(f"resume {i}"), 80) < 40)
    max_tokens = 80
    cut = _cut_inside_a_character(prompt, max_tokens)
    transcript = MockModel().transcript(prompt, max_tokens)

    async def scenario(dispatcher: Dispatcher) -> None:
        fake = FakeWorker(dispatcher.address, "fake", pid=4242)
        try:
            await fake.register()
            await _wait_ready(dispatcher, "fake")
            stream = await dispatcher.submit(MODEL, "r-resume", prompt, greedy(max_tokens), TIER)
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


def test_a_scored_prompt_whose_worker_falls_silent_is_scored_again_elsewhere(fleet: Fleet) -> None:
    """A prompt scored and nothing generated (echo with max_tokens 0): the fake worker sends the first
    chunk's logprobs and falls silent; the request moves (no token was seen, so from its start) and a
    real worker scores the whole prompt again from position 1: merged by position, each once."""
    prompt = prompt_ids("a prompt to score, moved once")
    scored = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=0)

    async def scenario(dispatcher: Dispatcher) -> None:
        fake = FakeWorker(dispatcher.address, "fake-scorer", pid=5005)
        try:
            await fake.register()
            await _wait_ready(dispatcher, "fake-scorer")
            stream = await dispatcher.submit(MODEL, "r-scored", prompt, scored, TIER)
            submit = await fake.receive()
            assert isinstance(submit, Submit) and submit.sampling.prompt_logprobs == 0
            first_chunk = [TokenLogprob(token_id=t, logprob=-1.0) for t in prompt[1:5]]
            usage = Usage(prompt_tokens=len(prompt), completion_tokens=0)
            partial = TokenDelta(
                request_id="r-scored", epoch=0, prompt_logprobs=first_chunk, prompt_position=1, usage=usage
            )
            await fake.send(TokenBatch(worker_id="fake-scorer", step=1, deltas=[partial]))
            deltas = await collect(stream)
            assert stream.worker_id in WORKER_IDS and stream.epoch == 1
            assert dispatcher.stats().num_migrations == {MODEL: 1}
            have: list[TokenLogprob] = []
            for delta in deltas:
                if delta.prompt_logprobs:
                    merge_prompt_logprobs(have, delta.prompt_position, delta.prompt_logprobs)
            assert [e.token_id for e in have] == prompt[1:]
            assert have[:4] == first_chunk  # the fake's, then the real worker's from position 5
            assert token_ids(deltas) == [] and deltas[-1].finish_reason == "length"
        finally:
            await fake.close()

    run(fleet, scenario, routing=Preferring("fake-scorer"))


def test_the_migration_limit_ends_the_stream_with_worker_lost(fleet: Fleet) -> None:
    """max_migrations = 1: fake A falls silent, the request moves to fake B (epoch 1, resuming after
    A's tokens); B falls silent too: the stream ends with WorkerLost naming the limit, never a hang."""
    prompt = prompt_ids("twice unlucky")
    transcript = MockModel().transcript(prompt, 50)

    async def scenario(dispatcher: Dispatcher) -> None:
        fake_a = FakeWorker(dispatcher.address, "fake-a", pid=1001)
        fake_b = FakeWorker(dispatcher.address, "fake-b", pid=1002)
        try:
            await fake_a.register()
            await fake_b.register()
            fake_b.start_beating(num_running=0)  # alive while fake-a falls silent
            await _wait_ready(dispatcher, "fake-a", "fake-b")
            stream = await dispatcher.submit(MODEL, "r-limit", prompt, greedy(50), TIER)
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
    prompt = prompt_ids("hung engine")
    hang_timeout_s = 1.0

    async def scenario(dispatcher: Dispatcher) -> None:
        fake = FakeWorker(dispatcher.address, "fake-hung", pid=3003)
        fake.num_steps = 10
        try:
            await fake.register()
            await _wait_ready(dispatcher, "fake-hung")
            started = time.monotonic()  # its first heartbeat with a request running is the last progress
            fake.start_beating(num_running=1)
            stream = await dispatcher.submit(MODEL, "r-hung", prompt, greedy(60), TIER)
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
