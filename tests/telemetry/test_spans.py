"""One trace per request inside one process: the gateway app (httpx's ASGI transport, a real Dispatcher)
and a real WorkerDaemon over a mock engine with a tiny KV cache, both exporting to one in-memory exporter.

The daemon runs in the main thread (it installs signal handlers); the gateway's event loop runs in a
second thread and stops the daemon through its inbound queue when the requests are done.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Sequence

import httpx
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.app import create_app
from gateway.dispatch import Dispatcher
from gateway.state import Gateway
from gateway.tokenizer import BytePromptBuilder
from gateway.workers import WorkerState
from telemetry import Telemetry
from telemetry import attributes as attr
from telemetry.http import ServerSpanMiddleware
from wire.config import ServerConfig
from wire.messages import Shutdown
from worker.config import EngineConfig
from worker.daemon import WorkerDaemon
from worker.engine import Engine
from worker.mock import MockCost, build_mock_engine
from worker.tracing import NULL_OBSERVER

TIMEOUT_S = 60.0
CLIENT_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"
NUM_OUTPUT = 150  # two such requests need 2 x 12 blocks of 16 tokens: more than the 16 the worker has
NUM_KV_BLOCKS = 16
CHAT_PROMPT_IDS = BytePromptBuilder().chat_ids([{"role": "user", "content": "hello"}])


def prompt(seed: int) -> list[int]:
    return [4 + (seed * 31 + i * 7) % 256 for i in range(40)]  # distinct from the first token: no sharing


def run_traffic(telemetry: Telemetry) -> tuple[list[httpx.Response], Engine]:
    """Two concurrent completions (one streamed) plus one chat request through a real daemon."""
    engine = build_mock_engine(
        EngineConfig(model="mock", num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=16),
        MockCost(fixed_ms=1.0),
    )
    addresses: queue.Queue[str] = queue.Queue()
    daemons: queue.Queue[WorkerDaemon] = queue.Queue()
    responses: list[httpx.Response] = []
    failures: list[BaseException] = []

    async def gateway_side() -> None:
        dispatcher = Dispatcher("tcp://127.0.0.1:0")
        await dispatcher.start()
        addresses.put(dispatcher.address)
        daemon = await asyncio.to_thread(daemons.get, timeout=TIMEOUT_S)
        try:
            registry = dispatcher.registry
            await dispatcher.wait_until(lambda: registry.num_in_state(WorkerState.READY) == 1, TIMEOUT_S)
            gateway = Gateway(
                dispatcher, ServerConfig(), {"mock": BytePromptBuilder()}, 0, telemetry=telemetry
            )
            transport = httpx.ASGITransport(app=create_app(gateway))
            async with httpx.AsyncClient(
                transport=transport, base_url="http://gateway", timeout=TIMEOUT_S
            ) as http:
                headers = {"traceparent": TRACEPARENT}

                async def completion(seed: int, stream: bool) -> httpx.Response:
                    body = {
                        "model": "mock",
                        "prompt": prompt(seed),
                        "max_tokens": NUM_OUTPUT,
                        "stream": stream,
                        "temperature": 0.5,
                        "ignore_eos": True,  # sampled, yet always NUM_OUTPUT tokens
                    }
                    return await http.post("/v1/completions", json=body, headers=headers)

                responses.extend(await asyncio.gather(completion(1, False), completion(2, True)))
                chat = {
                    "model": "mock",
                    "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 3,
                    "temperature": 0.5,
                    "ignore_eos": True,
                }
                responses.append(await http.post("/v1/chat/completions", json=chat, headers=headers))
                responses.append(await http.get("/metrics"))  # not traced
        finally:
            daemon.io.inbound.put(Shutdown(drain=False))
            await dispatcher.close()

    def gateway_thread() -> None:
        try:
            asyncio.run(gateway_side())
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=gateway_thread, daemon=True)
    thread.start()
    daemon = WorkerDaemon(
        engine, addresses.get(timeout=TIMEOUT_S), "mock-0", heartbeat_interval_s=0.2, model_name="mock",
        telemetry=telemetry,
    )  # fmt: skip
    daemons.put(daemon)
    assert daemon.run() == 0
    thread.join(TIMEOUT_S)
    assert not thread.is_alive()
    if failures:
        raise failures[0]
    assert [r.status_code for r in responses] == [200, 200, 200, 200]
    assert engine.scheduler.num_preemptions >= 1, "the test needs a forced preemption"
    return responses, engine


def traced() -> tuple[InMemorySpanExporter, Telemetry]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, Telemetry.from_provider(provider)


def children(
    spans: Sequence[ReadableSpan], parent: ReadableSpan, name: str | None = None
) -> list[ReadableSpan]:
    parent_id = parent.context.span_id
    return [
        s for s in spans if s.parent is not None and s.parent.span_id == parent_id and name in (None, s.name)
    ]


def chunk_of(span: ReadableSpan) -> tuple[int, int]:
    a = span.attributes or {}
    return int(a[attr.CHUNK_START]), int(a[attr.CHUNK_TOKENS])  # type: ignore[arg-type]


def test_one_trace_from_the_http_span_to_every_prefill_chunk() -> None:
    exporter, telemetry = traced()
    run_traffic(telemetry)
    spans = exporter.get_finished_spans()
    assert {s.context.trace_id for s in spans} == {CLIENT_TRACE_ID}  # the client's traceparent was honoured
    servers = [s for s in spans if s.kind is SpanKind.SERVER]
    assert sorted(s.name for s in servers) == ["POST /v1/chat/completions", *["POST /v1/completions"] * 2]
    preempted_events = 0
    for server in servers:
        assert server.parent is not None and server.parent.span_id == CLIENT_SPAN_ID
        a = server.attributes or {}
        is_chat = server.name.endswith("chat/completions")
        num_output = 3 if is_chat else NUM_OUTPUT
        assert a["http.request.method"] == "POST" and a["http.response.status_code"] == 200
        assert a["http.route"] == ("/v1/chat/completions" if is_chat else "/v1/completions")
        assert a[attr.GEN_AI_OPERATION_NAME] == ("chat" if is_chat else "text_completion")
        assert a[attr.GEN_AI_REQUEST_MODEL] == a[attr.GEN_AI_RESPONSE_MODEL] == "mock"
        assert a[attr.GEN_AI_REQUEST_MAX_TOKENS] == num_output
        assert a[attr.GEN_AI_REQUEST_TEMPERATURE] == 0.5
        assert a[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == num_output
        assert a[attr.GEN_AI_USAGE_INPUT_TOKENS] == (len(CHAT_PROMPT_IDS) if is_chat else 40)
        assert a[attr.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
        assert (
            a[attr.TIER] == "standard" and a[attr.TENANT] == "anonymous" and a[attr.CONTEXT_CLASS] == "short"
        )
        assert a[attr.WORKER] == "mock-0" and a[attr.DEGRADED] is False and a[attr.MIGRATIONS] == 0
        assert a[attr.CACHED_TOKENS] == 0
        assert 0 < float(a[attr.TIME_TO_FIRST_TOKEN]) < TIMEOUT_S  # type: ignore[arg-type]
        assert not any(key.startswith("gen_ai.input") or key.startswith("gen_ai.output") for key in a)
        # The gateway's steps, then the worker's part under the dispatch span.
        (classify,) = children(spans, server, attr.CLASSIFY)
        assert (classify.attributes or {})[attr.CONTEXT_CLASS] == "short"
        (admission,) = children(spans, server, attr.ADMISSION)
        assert (admission.attributes or {})[attr.QUEUE_TIME] >= 0
        (dispatch,) = children(spans, server, attr.DISPATCH)
        assert dispatch.kind is SpanKind.PRODUCER and (dispatch.attributes or {})[attr.WORKER] == "mock-0"
        # What routing weighed (least-loaded: minus requests and KV in use, per candidate).
        (route,) = children(spans, dispatch, attr.ROUTE)
        assert (route.attributes or {})[attr.ROUTE_CANDIDATES] == ("mock-0",)
        assert len((route.attributes or {})[attr.ROUTE_SCORES]) == 1  # type: ignore[arg-type]
        (request,) = children(spans, dispatch, attr.WORKER_REQUEST)
        assert request.resource.attributes.get("service.name") is not None
        r = request.attributes or {}
        assert r[attr.WORKER] == "mock-0" and r[attr.FINISH_REASON] == "length"
        assert r[attr.OUTPUT_TOKENS] == num_output
        (queue_span,) = children(spans, request, attr.WORKER_QUEUE)
        (decode,) = children(spans, request, attr.WORKER_DECODE)
        (finish,) = children(spans, request, attr.WORKER_FINISH)
        prefill = sorted(children(spans, request, attr.WORKER_PREFILL), key=lambda s: s.start_time or 0)
        assert queue_span.end_time is not None and prefill[0].start_time is not None
        assert queue_span.end_time <= prefill[0].start_time
        # Chunks of at most 16 tokens (max_num_batched_tokens, shared by both requests) that cover the
        # prompt back to back; a recompute after a preemption is a further pass.
        chunks = [chunk_of(p) for p in prefill]
        assert all(0 < num <= 16 for _, num in chunks)
        prompt_len = int(r[attr.PROMPT_TOKENS])  # type: ignore[arg-type]
        covered, num_first_pass = 0, 0
        while covered < prompt_len:
            assert chunks[num_first_pass][0] == covered
            covered += chunks[num_first_pass][1]
            num_first_pass += 1
        assert covered == prompt_len
        events = [e.name for e in decode.events]
        assert events.count(attr.EVENT_TOKENS) == num_output // attr.TOKENS_EVENT_INTERVAL
        preempted_events += events.count(attr.EVENT_PREEMPTED)
        if attr.EVENT_PREEMPTED in events:
            # Preempted mid-decode: recomputed (more prefill chunks), then resumed, counted on finish.
            assert events.count(attr.EVENT_RESUMED) == events.count(attr.EVENT_PREEMPTED)
            assert len(prefill) > num_first_pass and r[attr.PREEMPTIONS] >= 1
        assert decode.end_time == finish.end_time == request.end_time
        assert request.status.status_code is not StatusCode.ERROR
    assert preempted_events >= 1
    assert not any(s.name.startswith("GET") for s in spans)  # /metrics is not traced


def test_content_only_with_the_opt_in() -> None:
    exporter, telemetry = traced()
    telemetry.capture_content = True
    responses = run_traffic(telemetry)[0]
    spans = exporter.get_finished_spans()
    chat = next(s for s in spans if s.name == "POST /v1/chat/completions").attributes or {}
    assert '"content": "hello"' in str(chat[attr.GEN_AI_INPUT_MESSAGES])
    answer = responses[2].json()["choices"][0]["message"]["content"]
    assert json.loads(str(chat[attr.GEN_AI_OUTPUT_MESSAGES])) == [answer]
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in responses[1].text.splitlines()
             if line.startswith("data: {")]  # fmt: skip
    outputs = [json.loads(str((s.attributes or {})[attr.GEN_AI_OUTPUT_MESSAGES]))
               for s in spans if s.name == "POST /v1/completions"]  # fmt: skip
    assert ["".join(texts)] in outputs and len(texts) > 1


def test_tracing_off_installs_nothing() -> None:
    telemetry = Telemetry.off()
    engine = run_traffic(telemetry)[1]  # the same answers, with no observer and no server-span middleware
    assert engine.observer is NULL_OBSERVER

    async def middleware_of(telemetry: Telemetry) -> list[object]:
        dispatcher = Dispatcher("tcp://127.0.0.1:0")  # binds at once: always closed again
        try:
            gateway = Gateway(dispatcher, ServerConfig(), {}, 0, telemetry=telemetry)
            return [m.cls for m in create_app(gateway).user_middleware]
        finally:
            await dispatcher.close()

    assert ServerSpanMiddleware not in asyncio.run(middleware_of(telemetry))
    assert ServerSpanMiddleware in asyncio.run(middleware_of(traced()[1]))
