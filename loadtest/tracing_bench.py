"""The ``tracing-overhead`` scenario: the same mock load with tracing off, then on (100% sampled).

    tierserve bench tracing-overhead --json

Starts ``tierserve serve --mock 1`` twice on 127.0.0.1: once with no ``OTEL_*`` variable (tracing off:
no-op tracer, null engine observer), once with every request sampled and exported over OTLP/HTTP to
:class:`OtlpCollector`, a collector in this process that decodes each ``ExportTraceServiceRequest``.
The same seeded closed-loop chat workload runs against both; the figures are output tokens per second
of each and ``overhead_fraction = 1 - tok_s_on / tok_s_off``, measured in one run.

:class:`OtlpCollector` is also what ``tests/e2e/test_tracing.py`` receives spans with.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from loadtest.arrivals import ArrivalSpec
from loadtest.client import RequestOptions, Target
from loadtest.launch import log_tail, running_server
from loadtest.metrics import summarize
from loadtest.otlp_http import OtlpHttpReceiver
from loadtest.prompt_text import load_tokenizer
from loadtest.runner import Bounds, run_load
from loadtest.workloads import Api, Workload, WorkloadOptions
from wire.config import ServerConfig

READY_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class CollectedSpan:
    """One span as a collector received it, ids as hex strings (``parent_id`` "" for a root)."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int  # the proto's SpanKind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer
    start_ns: int
    end_ns: int
    attributes: dict[str, object]
    events: list[tuple[str, dict[str, object]]]
    resource: dict[str, object]
    status_code: int  # 0 unset, 1 ok, 2 error


@dataclass
class OtlpCollector:
    """A tiny OTLP/HTTP trace receiver on 127.0.0.1 (``POST /v1/traces``, protobuf, gzip or not)."""

    spans: list[CollectedSpan] = field(default_factory=list)
    num_requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: OtlpHttpReceiver[ExportTraceServiceRequest] | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "not started"
        return self._server.base_url

    def start(self) -> OtlpCollector:
        self._server = OtlpHttpReceiver(
            "/v1/traces", ExportTraceServiceRequest, ExportTraceServiceResponse(), self._add
        )
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def snapshot(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(
        self, predicate: Callable[[list[CollectedSpan]], bool], timeout_s: float
    ) -> list[CollectedSpan]:
        """Poll until ``predicate(spans)`` holds; ``TimeoutError`` naming what arrived at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise TimeoutError(
                    f"collector: condition not met in {timeout_s} s; {len(spans)} spans: {names}"
                )
            time.sleep(0.05)  # polling with a deadline, not synchronisation by sleeping

    def _add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        CollectedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in span.attributes},
                            events=[
                                (e.name, {kv.key: _value(kv.value) for kv in e.attributes})
                                for e in span.events
                            ],
                            resource=resource,
                            status_code=span.status.code,
                        )
                    )
        with self._lock:
            self.num_requests += 1
            self.spans.extend(received)


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind is not None else None


@contextmanager
def running_collector() -> Iterator[OtlpCollector]:
    collector = OtlpCollector().start()
    try:
        yield collector
    finally:
        collector.close()


def tracing_env(endpoint: str) -> dict[str, str]:
    """The ``OTEL_*`` variables that send every span to ``endpoint`` quickly (100 ms batches)."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRICS_EXPORTER": "none",
    }


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ for the block (serve and its workers inherit it), restored after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench tracing-overhead", description=__doc__)
    parser.add_argument("--num-requests", type=int, default=320, help="measured, per mode")
    parser.add_argument("--warmup", type=int, default=64, help="requests sent first, not measured")
    parser.add_argument("--concurrency", type=int, default=32, help="closed loop")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="off, on, off, on, ...: order effects cancel")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, object]:
    config = ServerConfig()
    with running_collector() as collector, tempfile.TemporaryDirectory(prefix="tracing-bench-") as tmp:
        runs_off: list[_Measured] = []
        runs_on: list[_Measured] = []
        for i in range(args.rounds):
            runs_off.append(_measure(args, config, Path(tmp) / f"off-{i}.log", {}))
            runs_on.append(_measure(args, config, Path(tmp) / f"on-{i}.log", tracing_env(collector.endpoint)))
        spans = collector.snapshot()
    tok_s_off = sum(r.tok_s for r in runs_off) / len(runs_off)
    tok_s_on = sum(r.tok_s for r in runs_on) / len(runs_on)
    cpu_off = sum(r.cpu_ms_per_1k_tokens for r in runs_off) / len(runs_off)
    cpu_on = sum(r.cpu_ms_per_1k_tokens for r in runs_on) / len(runs_on)
    return {
        "scenario": "tracing-overhead",
        "mock_workers": 1,
        "workload": f"chat, closed loop x{args.concurrency}, {args.num_requests} requests per mode "
        f"after {args.warmup} warm-up requests, {args.output_len} output tokens, streamed",
        "sampling": "always_on (100%)",
        "exporter": "OTLP/HTTP protobuf to a collector on 127.0.0.1",
        "tok_s_off": round(tok_s_off, 2),
        "tok_s_on": round(tok_s_on, 2),
        "overhead_fraction": round(1 - tok_s_on / tok_s_off, 4),
        "rounds": args.rounds,
        "tok_s_off_each": [round(r.tok_s, 1) for r in runs_off],
        "tok_s_on_each": [round(r.tok_s, 1) for r in runs_on],
        # CPU time of serve and its worker per 1,000 output tokens: steadier than throughput on a shared
        # machine, and it counts the exporter threads' work even when the cores had time to spare.
        "cpu_ms_per_1k_tokens_off": round(cpu_off, 1),
        "cpu_ms_per_1k_tokens_on": round(cpu_on, 1),
        "cpu_overhead_fraction": round(cpu_on / cpu_off - 1, 4),
        "spans_received": len(spans),
        "traces_received": len({s.trace_id for s in spans}),
    }


@dataclass(frozen=True, slots=True)
class _Measured:
    tok_s: float
    cpu_ms_per_1k_tokens: float


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (Linux /proc; fields 14 and 15 of ``stat``)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _measure(
    args: argparse.Namespace, config: ServerConfig, log_path: Path, env: Mapping[str, str]
) -> _Measured:
    """Output tokens per second (and CPU per token) of one closed-loop run against a fresh serve."""
    try:
        with environment(env), running_server(["--mock", "1"], log_path, READY_TIMEOUT_S) as server:
            target = Target("base", server.base_url, "mock", config.default_tier)
            options = WorkloadOptions(prompt_len=(64, 128), output_len=(args.output_len, args.output_len))
            workload = Workload("chat", load_tokenizer("bytes", "mock"), Api.CHAT, args.seed, options)
            request_options = RequestOptions(Api.CHAT, True, 0.0, True, {}, timeout_s=120.0)
            # A warm-up first (imports, caches, the first batches of spans), then the measured run.
            warmup = Bounds(args.warmup, None, args.concurrency)
            asyncio.run(
                run_load([target], workload, ArrivalSpec(None), args.seed + 1, warmup, request_options)
            )
            bounds = Bounds(args.num_requests, None, args.concurrency)
            pids = [server.process.pid, *server.worker_pids()]
            cpu_before = _cpu_s(pids)
            result = asyncio.run(
                run_load([target], workload, ArrivalSpec(None), args.seed, bounds, request_options)
            )
            cpu_s = _cpu_s(pids) - cpu_before
    except BaseException:
        print(f"[tracing-overhead] the server's log ends with:\n{log_tail(log_path)}", file=sys.stderr)
        raise
    records = result.records
    duration = max(r.t_end for r in records) - min(r.t_sent for r in records)
    overall = summarize(records, {t.name: t for t in config.tiers}, duration).overall
    if overall.num_ok != args.num_requests:
        raise RuntimeError(f"{args.num_requests - overall.num_ok} requests failed; see {log_path}")
    num_tokens = sum(r.num_output_tokens or 0 for r in records)
    return _Measured(overall.output_tok_s, cpu_s * 1e6 / num_tokens)
