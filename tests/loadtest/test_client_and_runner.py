"""The client's reading of answers and failures, and the runner's bounds, against an in-memory
transport (httpx.MockTransport): no sockets, no server, deterministic."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable

import httpx
import msgspec
import pytest

from gateway.errors import APIError
from gateway.openai_api import ChoiceResult
from gateway.openai_types import UsageInfo
from gateway.responses_api import ResponsesRenderer
from gateway.responses_requests import decode_responses
from loadtest.arrivals import ArrivalKind, ArrivalSpec
from loadtest.client import RequestOptions, Target, request_body, send
from loadtest.prompt_text import load_tokenizer
from loadtest.records import Outcome, RequestRecord
from loadtest.runner import Bounds, planned_requests, run_load
from loadtest.workloads import Api, RequestSpec, Workload, WorkloadOptions
from wire.messages import TokenDelta, Usage

TARGET = Target("base", "http://127.0.0.1:9/v1", "m", default_tier="standard")
SPEC = RequestSpec(0, [{"role": "user", "content": "hi"}], None, 12, 3, tier="interactive")


def options(api: Api = Api.CHAT, stream: bool = True, timeout_s: float = 5.0) -> RequestOptions:
    return RequestOptions(api, stream, 0.0, True, {"Authorization": "Bearer k"}, timeout_s)


def sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def chat_chunk(text: str | None, finish: str | None = None) -> dict[str, object]:
    delta = {} if text is None else {"content": text}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {
    "choices": [],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}},
}


def run_one(
    handler: Callable[[httpx.Request], httpx.Response], opts: RequestOptions | None = None
) -> RequestRecord:
    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send(client, TARGET, SPEC, opts or options(), 0.0)

    return asyncio.run(go())


def test_stream_is_timed_and_usage_read() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = sse(chat_chunk(None), chat_chunk("a"), chat_chunk("bc"), chat_chunk("", "length"), USAGE)
        return httpx.Response(200, content=body, headers={"x-sla-tier": "batch"})

    record = run_one(handler)
    assert record.outcome is Outcome.OK
    assert len(record.chunk_times) == 2  # the role chunk and the empty final one carry no text
    assert (record.num_prompt_tokens, record.num_output_tokens, record.num_cached_tokens) == (12, 3, 8)
    assert record.tier == "batch"  # what the server echoed wins
    request = seen[0]
    assert request.url == "http://127.0.0.1:9/v1/chat/completions"
    assert request.headers["x-sla-tier"] == "interactive"
    assert request.headers["authorization"] == "Bearer k"
    body = json.loads(request.content)
    assert body["stream_options"] == {"include_usage": True} and body["stream"] is True
    assert (body["model"], body["max_tokens"], body["ignore_eos"]) == ("m", 3, True)
    assert body["messages"] == SPEC.messages
    assert "priority" not in body


def test_priorities_put_the_tier_in_the_body() -> None:
    with_priority = dataclasses.replace(options(), priorities={"interactive": 0})
    assert request_body(SPEC, "m", with_priority)["priority"] == 0
    batch = RequestSpec(1, SPEC.messages, None, 12, 3, tier="batch")  # not in the map: no priority
    assert "priority" not in request_body(batch, "m", with_priority)


def test_completions_text_chunks_without_usage_count_chunks() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        assert json.loads(request.content)["prompt"] == "p"
        chunks = [
            {"choices": [{"text": t, "finish_reason": f}]}
            for t, f in (("x", None), ("y", None), ("z", "stop"))
        ]
        return httpx.Response(200, content=sse(*chunks))

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            spec = RequestSpec(1, None, "p", 1, 3, None)
            return await send(client, TARGET, spec, options(Api.COMPLETIONS), 0.0)

    record = asyncio.run(go())
    assert record.outcome is Outcome.OK
    assert (record.num_output_tokens, record.num_prompt_tokens) == (3, None)
    assert record.tier == "standard"  # nothing asked or echoed: the default tier


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(429, Outcome.RATE_LIMITED), (400, Outcome.HTTP_4XX), (401, Outcome.HTTP_4XX), (503, Outcome.HTTP_5XX)],
)
def test_error_statuses(status: int, outcome: Outcome) -> None:
    record = run_one(lambda r: httpx.Response(status, json={"error": {"message": "no"}}))
    assert (record.outcome, record.status) == (outcome, status)
    assert "no" in record.error


def test_error_event_mid_stream_and_unfinished_stream() -> None:
    failing = sse(chat_chunk("a"), {"error": {"message": "worker lost", "code": "worker_lost"}})
    record = run_one(lambda r: httpx.Response(200, content=failing))
    assert record.outcome is Outcome.STREAM_ERROR and "worker lost" in record.error
    cut = b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}\n\n'
    record = run_one(lambda r: httpx.Response(200, content=cut))
    assert record.outcome is Outcome.STREAM_ERROR


def test_timeouts_and_refused_connections() -> None:
    def read_timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    assert run_one(read_timeout).outcome is Outcome.TIMEOUT
    assert run_one(refused).outcome is Outcome.TRANSPORT_ERROR

    async def never_ends() -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}\n\n'
        await asyncio.sleep(10)

    record = run_one(lambda r: httpx.Response(200, content=never_ends()), options(timeout_s=0.2))
    assert record.outcome is Outcome.TIMEOUT  # the whole-answer bound


CLOSED = "Server disconnected without sending a response."  # httpx's words for it


def test_a_connection_closed_before_any_answer_is_sent_once_more() -> None:
    """A kept-alive connection the server closed as the request went out (llama.cpp's server, now and
    then): nothing was answered, so the request goes again; a second such close is the outcome."""
    calls: list[int] = []
    answer = sse(chat_chunk("a"), chat_chunk("bc", "length"), USAGE)

    def closes_once(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError(CLOSED, request=request)
        return httpx.Response(200, content=answer)

    record = run_one(closes_once)
    assert (record.outcome, record.num_retries, len(calls)) == (Outcome.OK, 1, 2)
    assert record.num_output_tokens == 3

    def always_closes(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.RemoteProtocolError(CLOSED, request=request)

    calls.clear()
    record = run_one(always_closes)
    assert (record.outcome, record.status, len(calls)) == (Outcome.TRANSPORT_ERROR, None, 2)
    assert "disconnected" in record.error


def test_a_connection_lost_mid_answer_is_not_sent_again() -> None:
    calls: list[int] = []

    async def cut_off() -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(200, content=cut_off())

    record = run_one(handler)
    assert (record.outcome, record.status, record.num_retries, len(calls)) == (
        Outcome.TRANSPORT_ERROR, 200, 0, 1,
    )  # fmt: skip


def test_non_streamed_answer() -> None:
    whole = {"choices": [{"message": {"content": "abc"}, "finish_reason": "length"}], "usage": USAGE["usage"]}
    record = run_one(lambda r: httpx.Response(200, json=whole), options(stream=False))
    assert record.outcome is Outcome.OK and len(record.chunk_times) == 1
    assert record.num_output_tokens == 3


class FakeServer:
    """Answers every request after ``delay_s``, tracking how many are in flight at once."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.in_flight = self.max_in_flight = 0
        self.requests: list[dict[str, object]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(json.loads(request.content))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        return httpx.Response(200, content=sse(chat_chunk("a"), chat_chunk("b", "length")))


def drive(
    server: FakeServer, arrivals: ArrivalSpec, bounds: Bounds, num_targets: int = 1
) -> list[RequestRecord]:
    workload = Workload(
        "chat", load_tokenizer("bytes", "mock"), Api.CHAT, 0, WorkloadOptions(prompt_len=(20, 40))
    )
    targets = [TARGET, Target("compare", "http://127.0.0.1:10", "m2", "standard")][:num_targets]
    run = asyncio.run(
        run_load(targets, workload, arrivals, 0, bounds, options(), transport=httpx.MockTransport(server))
    )
    return run.records


def test_closed_loop_keeps_exactly_the_concurrency_in_flight() -> None:
    server = FakeServer(delay_s=0.02)
    records = drive(server, ArrivalSpec(None), Bounds(max_requests=20, duration_s=None, concurrency=3))
    assert len(records) == 20 == len(server.requests)
    assert server.max_in_flight == 3


def test_open_loop_stops_at_the_duration() -> None:
    arrivals = ArrivalSpec(100.0, ArrivalKind.FIXED)
    bounds = Bounds(max_requests=None, duration_s=0.15, concurrency=None)
    server = FakeServer(delay_s=0.001)
    records = drive(server, arrivals, bounds)
    assert len(records) == planned_requests(arrivals, 0, bounds) == 14  # offsets 0.01 … 0.14
    sent = sorted(r.t_sent for r in records)
    assert sent[0] >= 0.01 and sent[-1] < 0.15 + 0.1  # on schedule, give or take the event loop


def test_compare_sends_the_same_requests_to_both() -> None:
    server = FakeServer(delay_s=0.001)
    records = drive(server, ArrivalSpec(200.0), Bounds(10, None, None), num_targets=2)
    by_target = Counter(r.target for r in records)
    assert by_target == {"base": 10, "compare": 10}
    models = Counter(str(r["model"]) for r in server.requests)
    assert models == {"m": 10, "m2": 10}
    bodies = {(str(r["model"]), json.dumps(r["messages"])) for r in server.requests}
    assert {b for m, b in bodies if m == "m"} == {b for m, b in bodies if m == "m2"}


def responses_answer(stream: bool, fail: bool = False) -> bytes:
    """What the gateway's own Responses renderer sends for "a", "bc", then a cut (or a failure)."""
    chat = decode_responses(json.dumps({"model": "m", "input": "hi"}).encode())
    assert chat.origin is not None
    renderer = ResponsesRenderer("resp_1", "m", chat.origin)
    last = Usage(prompt_tokens=12, completion_tokens=3, cached_tokens=8)
    usage = UsageInfo.total([last], [0])
    if not stream:
        return msgspec.json.encode(renderer.whole([ChoiceResult(0, "abc", [], "length")], usage))
    deltas = [TokenDelta(request_id="r", epoch=0, text=t, usage=last) for t in ("a", "bc")]
    payloads = [*renderer.opening(0), *(p for d in deltas for p in renderer.chunks(0, d))]
    if fail:
        payloads += renderer.failure(APIError(502, "worker lost", code="worker_lost").body(), 502)
    else:
        payloads += renderer.chunks(
            0, TokenDelta(request_id="r", epoch=0, finish_reason="length", usage=last)
        )
        payloads += renderer.closing(usage)
    return b"".join(renderer.frame(p) for p in payloads)


def test_the_responses_api_is_timed_by_its_text_deltas_and_read_to_its_last_event() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=responses_answer(stream=True))

    record = run_one(handler, options(Api.RESPONSES))
    assert record.outcome is Outcome.OK and len(record.chunk_times) == 2
    assert (record.num_prompt_tokens, record.num_output_tokens, record.num_cached_tokens) == (12, 3, 8)
    assert seen[0].url == "http://127.0.0.1:9/v1/responses"
    body = json.loads(seen[0].content)
    assert (body["input"], body["max_output_tokens"], body["stream"]) == (SPEC.messages, 3, True)
    assert "stream_options" not in body and "max_tokens" not in body and body["ignore_eos"] is True
    whole = run_one(
        lambda r: httpx.Response(200, content=responses_answer(stream=False)),
        options(Api.RESPONSES, stream=False),
    )
    assert whole.outcome is Outcome.OK and (whole.num_prompt_tokens, whole.num_output_tokens) == (12, 3)
    failed = run_one(
        lambda r: httpx.Response(200, content=responses_answer(stream=True, fail=True)),
        options(Api.RESPONSES),
    )
    assert failed.outcome is Outcome.STREAM_ERROR and "worker lost" in failed.error
