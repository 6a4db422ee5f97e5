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
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.failover_bench import num_ready, wait_for, worker_processes
from loadtest.launch import Server, free_port, log_tail, running_server
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


def test_a_responses_api_request_is_one_trace_of_a_chat(traced_server: tuple[Server, OtlpCollector]) -> None:
    """``/v1/responses`` runs the chat path: its server span says so, with the response's id."""
    server, collector = traced_server
    body = {"model": "mock", "input": "hi", "max_output_tokens": 5, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=DEADLINE_S) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("event: ")]
    assert events[-1] == "event: response.incomplete"

    def served(spans: list[CollectedSpan]) -> bool:
        return any(s.kind == SERVER for s in spans) and any(s.name == attr.WORKER_REQUEST for s in spans)

    spans = collector.wait_for(served, DEADLINE_S)
    (root,) = [s for s in spans if s.kind == SERVER]
    assert root.name == "POST /v1/responses" and root.attributes["http.route"] == "/v1/responses"
    assert root.attributes[attr.GEN_AI_OPERATION_NAME] == "chat"
    assert str(root.attributes[attr.GEN_AI_RESPONSE_ID]).startswith("resp_")
    assert root.attributes[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    (dispatch,) = by_parent(spans, root, attr.DISPATCH)
    assert by_parent(spans, dispatch, attr.WORKER_REQUEST)  # into the engine, in the same trace


FAILOVER_CONFIG = """
[gateway]
heartbeat_timeout_s = 1.5
"""
FAILOVER_TOKENS = 800  # ~4 s of 5 ms mock steps: the stream is still running when its worker is killed


def everything_of_the_migration(spans: list[CollectedSpan]) -> bool:
    """The gateway's server span and the survivor's request span: they come from two processes."""
    resumed = [s for s in spans if s.name == attr.WORKER_REQUEST and s.attributes.get("tierserve.epoch") == 1]
    return any(s.kind == SERVER for s in spans) and bool(resumed)


def test_a_migrated_request_stays_one_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL the worker running a stream: the request moves (epoch 1) and its trace says so."""
    (tmp_path / "tierserve.toml").write_text(FAILOVER_CONFIG)
    args = ["--mock", "2", "--config", str(tmp_path / "tierserve.toml")]
    with running_collector() as collector:
        for name, value in tracing_env(collector.endpoint).items():
            monkeypatch.setenv(name, value)
        with running_server(args, tmp_path / "serve.log", ready_timeout_s=60) as server:
            # /ready answers once one worker is; serve gives up if a worker dies before all are ready.
            wait_for(lambda: num_ready(server.base_url) == 2, 60, "both workers ready")
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
            spans = collector.wait_for(everything_of_the_migration, DEADLINE_S)
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


# ---- a real APM: Arize Phoenix (opt-in: `make test-apm`, or TIERSERVE_APM_TEST=1) ------------------

PHOENIX = os.environ.get(
    "TIERSERVE_APM_PHOENIX", str(Path(__file__).resolve().parents[2] / ".cache/apm-venv/bin/phoenix")
)
PHOENIX_PROJECT = "tierserve-apm"
PHOENIX_START_TIMEOUT_S = 240.0  # a cold first start imports ~850 MB of packages and migrates SQLite
PHOENIX_TEST_TIMEOUT_S = 480  # the start, serve, the traffic and the spans' arrival


def flatten(value: object, prefix: str = "") -> dict[str, object]:
    """Phoenix returns attributes nested by their dotted path: back to OpenTelemetry's flat keys."""
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, object] = {}
    for key, inner in value.items():
        flat.update(flatten(inner, f"{prefix}.{key}" if prefix else key))
    return flat


def phoenix_spans(base_url: str) -> list[dict[str, object]]:
    spans: list[dict[str, object]] = []
    cursor: str | None = None
    while True:
        params: dict[str, str | int] = {"limit": 1000}
        if cursor:
            params["cursor"] = cursor
        answer = httpx.get(f"{base_url}/v1/projects/{PHOENIX_PROJECT}/spans", params=params, timeout=30)
        if answer.status_code == 404:
            return []  # no span has created the project yet
        answer.raise_for_status()
        body = answer.json()
        spans += body["data"]
        cursor = body.get("next_cursor")
        if not cursor:
            return spans


def _phoenix_log(tmp_path: Path) -> str:
    return "Phoenix's log ends:\n" + log_tail(tmp_path / "phoenix.log")


@pytest.mark.skipif(os.environ.get("TIERSERVE_APM_TEST") != "1", reason="needs Phoenix: make test-apm")
@pytest.mark.timeout(PHOENIX_TEST_TIMEOUT_S)
def test_phoenix_stores_the_whole_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path(PHOENIX).exists():
        pytest.fail(f"{PHOENIX} not found: `make test-apm` installs Phoenix into .cache/apm-venv")
    port, grpc_port = free_port(), free_port()
    env = {
        **os.environ,
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_WORKING_DIR": str(tmp_path / "phoenix"),
    }
    with (tmp_path / "phoenix.log").open("wb") as log:
        phoenix = subprocess.Popen([PHOENIX, "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + PHOENIX_START_TIMEOUT_S
        while not _answers(f"{base_url}/healthz"):
            assert phoenix.poll() is None, f"Phoenix exited ({phoenix.returncode}); {_phoenix_log(tmp_path)}"
            assert time.monotonic() < deadline, f"Phoenix did not answer in time; {_phoenix_log(tmp_path)}"
            time.sleep(0.2)  # polling its health endpoint under a deadline
        for name in ("TIERSERVE_APM_TEST", "TIERSERVE_APM_PHOENIX"):  # serve reads TIERSERVE_* as config keys
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{base_url}/v1/traces")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "tierserve-apm")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"openinference.project.name={PHOENIX_PROJECT}")
        with running_server(["--mock", "1"], tmp_path / "serve.log", ready_timeout_s=60) as server:
            responses = asyncio.run(send_all(server.base_url))  # 2 of 8 streamed; forces a preemption
            assert [r.status_code for r in responses] == [200] * NUM_REQUESTS
            deadline = time.monotonic() + DEADLINE_S
            while True:
                stored = phoenix_spans(base_url)
                names = [s["name"] for s in stored]
                if (
                    names.count(attr.WORKER_REQUEST) == NUM_REQUESTS
                    and names.count("POST /v1/completions") == NUM_REQUESTS
                ):
                    break
                assert time.monotonic() < deadline, (
                    f"Phoenix has {len(stored)} spans: {sorted(set(names))}; {_phoenix_log(tmp_path)}"  # type: ignore[type-var]
                )
                time.sleep(0.2)
    finally:
        phoenix.terminate()
        try:
            phoenix.wait(timeout=30)
        except subprocess.TimeoutExpired:
            phoenix.kill()
            phoenix.wait()
    spans = [
        CollectedSpan(
            trace_id=str(s["context"]["trace_id"]),  # type: ignore[index]
            span_id=str(s["context"]["span_id"]),  # type: ignore[index]
            parent_id=str(s.get("parent_id") or ""),
            name=str(s["name"]),
            kind=0,
            start_ns=0,
            end_ns=0,
            attributes=flatten(s.get("attributes") or {}),
            events=[(str(e["name"]), flatten(e.get("attributes") or {})) for e in s.get("events") or []],  # type: ignore[attr-defined]
            resource={},
            status_code=0,
        )
        for s in stored
    ]
    preempted = 0
    for root in [s for s in spans if s.name == "POST /v1/completions"]:
        assert root.parent_id == ""
        a = root.attributes
        assert a[attr.GEN_AI_OPERATION_NAME] == "text_completion" and a[attr.GEN_AI_REQUEST_MODEL] == "mock"
        assert (
            a[attr.GEN_AI_USAGE_INPUT_TOKENS] == PROMPT_LEN
            and a[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == MAX_TOKENS
        )
        assert a[attr.TIER] == "interactive" and a[attr.WORKER] == "mock-0"
        assert a["http.response.status_code"] == 200
        for name in (attr.CLASSIFY, attr.ADMISSION):
            assert len(by_parent(spans, root, name)) == 1
        (dispatch,) = by_parent(spans, root, attr.DISPATCH)
        (request,) = by_parent(spans, dispatch, attr.WORKER_REQUEST)  # the worker process's, same trace
        assert request.attributes[attr.FINISH_REASON] == "length"
        for name in (attr.WORKER_QUEUE, attr.WORKER_DECODE, attr.WORKER_FINISH):
            assert len(by_parent(spans, request, name)) == 1
        assert by_parent(spans, request, attr.WORKER_PREFILL)
        (decode,) = by_parent(spans, request, attr.WORKER_DECODE)
        preempted += [name for name, _ in decode.events + request.events].count(attr.EVENT_PREEMPTED)
    assert preempted >= 1


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
