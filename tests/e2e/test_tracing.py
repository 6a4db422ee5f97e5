"""Traces end to end: ``tierserve serve --mock 1`` exporting OTLP/HTTP to a collector in this test.

Both processes (the gateway and its worker) send spans to :class:`OtlpCollector`, which decodes the
protobuf ``ExportTraceServiceRequest`` bodies. Eight concurrent completions of 1,000 distinct prompt tokens
and 100 output tokens need 8 x 69 KV blocks of 16 tokens, more than the mock worker's 512: a preemption
is forced. Every request must come back as one trace across the process boundary: the gateway's server
span → classify / admission / dispatch → (in the worker's process) the worker request span → queue,
prefill chunks, decode (with its events), finish. The collector is polled with a deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.failover_bench import worker_processes
from loadtest.launch import Server, running_server
from loadtest.tracing_bench import CollectedSpan, OtlpCollector, running_collector, tracing_env
from telemetry import attributes as attr

pytestmark = pytest.mark.timeout(180)

NUM_REQUESTS = 8
PROMPT_LEN = 1000
MAX_TOKENS = 100
DEADLINE_S = 60.0
SERVER, PRODUCER, CONSUMER = 2, 4, 5  # the proto's SpanKind values


@pytest.fixture
def traced_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Server, OtlpCollector]]:
    with running_collector() as collector:
        for name, value in tracing_env(collector.endpoint).items():
            monkeypatch.setenv(name, value)  # serve and its worker inherit them
        monkeypatch.setenv("OTEL_SERVICE_NAME", "tierserve-e2e")
        monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
        with running_server(["--mock", "1"], tmp_path / "serve.log", ready_timeout_s=60) as server:
            yield server, collector


def prompt(i: int) -> list[int]:
    # Byte tokens (ids 4..259), distinct from the first token on: no prefix is shared, every block counts.
    return [4 + (i * 97 + j * 31 + j * j) % 256 for j in range(PROMPT_LEN)]


async def send_all(base_url: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S) as client:

        async def one(i: int) -> httpx.Response:
            body = {"model": "mock", "prompt": prompt(i), "max_tokens": MAX_TOKENS, "stream": i % 4 == 0,
                    "temperature": 0.5, "ignore_eos": True}  # fmt: skip
            return await client.post("/v1/completions", json=body, headers={"x-sla-tier": "interactive"})

        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))


def by_parent(spans: list[CollectedSpan], parent: CollectedSpan, name: str) -> list[CollectedSpan]:
    return [
        s for s in spans if s.parent_id == parent.span_id and s.trace_id == parent.trace_id and s.name == name
    ]


def test_one_trace_per_request_across_the_process_boundary(
    traced_server: tuple[Server, OtlpCollector],
) -> None:
    server, collector = traced_server
    responses = asyncio.run(send_all(server.base_url))
    assert [r.status_code for r in responses] == [200] * NUM_REQUESTS

    def complete(spans: list[CollectedSpan]) -> bool:
        servers = [s for s in spans if s.kind == SERVER]
        finished = [s for s in spans if s.name == attr.WORKER_REQUEST]
        return len(servers) == NUM_REQUESTS and len(finished) == NUM_REQUESTS

    spans = collector.wait_for(complete, DEADLINE_S)
    servers = [s for s in spans if s.kind == SERVER]
    assert len({s.trace_id for s in servers}) == NUM_REQUESTS  # one trace per request
    preempted = resumed = 0
    for root in servers:
        assert root.parent_id == ""  # no traceparent from this client: the server span is the root
        assert root.name == "POST /v1/completions"
        assert root.resource["service.name"] == "tierserve-e2e"
        assert root.resource["tierserve.component"] == "gateway"
        a = root.attributes
        assert a["http.request.method"] == "POST" and a["http.response.status_code"] == 200
        assert a["http.route"] == "/v1/completions" and a["server.address"] == "127.0.0.1"
        assert a[attr.GEN_AI_OPERATION_NAME] == "text_completion"
        assert a[attr.GEN_AI_REQUEST_MODEL] == a[attr.GEN_AI_RESPONSE_MODEL] == "mock"
        assert a[attr.GEN_AI_REQUEST_MAX_TOKENS] == MAX_TOKENS
        assert a[attr.GEN_AI_REQUEST_TEMPERATURE] == 0.5
        assert a[attr.GEN_AI_USAGE_INPUT_TOKENS] == PROMPT_LEN
        assert a[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == MAX_TOKENS
        assert a[attr.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
        assert a[attr.TIER] == "interactive" and a[attr.TENANT] == "anonymous"
        assert a[attr.CONTEXT_CLASS] == "short" and a[attr.DEGRADED] is False
        assert a[attr.WORKER] == "mock-0" and a[attr.MIGRATIONS] == 0 and a[attr.CACHED_TOKENS] == 0
        assert isinstance(a[attr.TIME_TO_FIRST_TOKEN], float) and a[attr.TIME_TO_FIRST_TOKEN] > 0
        assert not any(key.startswith(("gen_ai.input", "gen_ai.output")) for key in a)  # no text by default
        (classify,) = by_parent(spans, root, attr.CLASSIFY)
        (_admission,) = by_parent(spans, root, attr.ADMISSION)
        (dispatch,) = by_parent(spans, root, attr.DISPATCH)
        assert classify.attributes[attr.TIER] == "interactive"
        assert dispatch.kind == PRODUCER and dispatch.attributes[attr.WORKER] == "mock-0"
        # Across the process boundary: the worker's span is the dispatch span's child, in the same trace.
        (request,) = by_parent(spans, dispatch, attr.WORKER_REQUEST)
        assert request.kind == CONSUMER and request.resource["tierserve.component"] == "worker"
        assert request.resource["service.name"] == "tierserve-e2e"
        assert root.resource["process.pid"] == server.process.pid
        assert request.resource["process.pid"] in server.worker_pids()
        assert request.attributes[attr.PROMPT_TOKENS] == PROMPT_LEN
        assert request.attributes[attr.FINISH_REASON] == "length"
        assert request.attributes[attr.OUTPUT_TOKENS] == MAX_TOKENS
        (queue,) = by_parent(spans, request, attr.WORKER_QUEUE)
        (decode,) = by_parent(spans, request, attr.WORKER_DECODE)
        (finish,) = by_parent(spans, request, attr.WORKER_FINISH)
        prefill = by_parent(spans, request, attr.WORKER_PREFILL)
        assert prefill and sum(int(p.attributes[attr.CHUNK_TOKENS]) for p in prefill) >= PROMPT_LEN  # type: ignore[call-overload]
        assert queue.end_ns <= min(p.start_ns for p in prefill) <= decode.start_ns
        assert root.start_ns <= request.start_ns and request.end_ns <= root.end_ns
        assert finish.attributes[attr.FINISH_REASON] == "length"
        events = [name for name, _ in decode.events] + [name for name, _ in request.events]
        assert events.count(attr.EVENT_TOKENS) == MAX_TOKENS // attr.TOKENS_EVENT_INTERVAL
        preempted += events.count(attr.EVENT_PREEMPTED)
        resumed += events.count(attr.EVENT_RESUMED)
        assert request.attributes[attr.PREEMPTIONS] == events.count(attr.EVENT_PREEMPTED)
    assert preempted >= 1 and resumed == preempted  # forced by the small cache; every victim came back


FAILOVER_CONFIG = """
[gateway]
heartbeat_timeout_s = 1.5
"""
FAILOVER_TOKENS = 800  # ~4 s of 5 ms mock steps: the stream is still running when its worker is killed


def test_a_migrated_request_stays_one_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL the worker running a stream: the request moves (epoch 1) and its trace says so."""
    (tmp_path / "tierserve.toml").write_text(FAILOVER_CONFIG)
    args = ["--mock", "2", "--config", str(tmp_path / "tierserve.toml")]
    with running_collector() as collector:
        for name, value in tracing_env(collector.endpoint).items():
            monkeypatch.setenv(name, value)
        with running_server(args, tmp_path / "serve.log", ready_timeout_s=60) as server:
            pids = worker_processes(server)

            async def stream_and_kill() -> tuple[int, int]:
                body = {"model": "mock", "prompt": "tell me", "max_tokens": FAILOVER_TOKENS, "stream": True,
                        "ignore_eos": True}  # fmt: skip
                num_chunks = 0
                async with (
                    httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S) as client,
                    client.stream("POST", "/v1/completions", json=body) as response,
                ):
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            num_chunks += 1
                        if num_chunks == 1:  # running: find its worker from the exported dispatch span
                            spans = await asyncio.to_thread(
                                collector.wait_for,
                                lambda s: any(x.name == attr.DISPATCH for x in s),
                                DEADLINE_S,
                            )
                            (dispatch,) = [s for s in spans if s.name == attr.DISPATCH]
                            os.kill(pids[str(dispatch.attributes[attr.WORKER])], signal.SIGKILL)
                    return response.status_code, num_chunks

            status, num_chunks = asyncio.run(stream_and_kill())
            assert status == 200 and num_chunks >= 2
            spans = collector.wait_for(lambda s: any(x.kind == SERVER for x in s), DEADLINE_S)
    (root,) = [s for s in spans if s.kind == SERVER]
    (dispatch,) = by_parent(spans, root, attr.DISPATCH)
    killed = str(dispatch.attributes[attr.WORKER])
    (survivor,) = set(pids) - {killed}
    assert root.attributes[attr.MIGRATIONS] == 1 and root.attributes[attr.WORKER] == survivor
    assert root.attributes[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == FAILOVER_TOKENS
    # The survivor's part hangs under the same dispatch span (the killed worker's never got exported).
    (request,) = by_parent(spans, dispatch, attr.WORKER_REQUEST)
    assert request.attributes[attr.WORKER] == survivor and request.attributes["tierserve.epoch"] == 1
    assert 0 < int(request.attributes["tierserve.resumed_tokens"]) < FAILOVER_TOKENS  # type: ignore[call-overload]
