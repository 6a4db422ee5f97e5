"""Metrics over OTLP end to end: ``tierserve serve --mock 1`` pushing to a collector in this test.

The collector is a plain HTTP server (``POST /v1/metrics``, protobuf ``ExportMetricsServiceRequest``)
or a gRPC ``MetricsService``; the server exports every 200 ms. After some traffic, the export that
follows it must carry, under the OTLP names and units of gateway/instruments.py, exactly the per-request
figures ``/metrics`` shows, every other metric with its attributes, and the gateway's resource.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from gateway.instruments import OTLP
from loadtest.launch import running_server
from loadtest.otlp_http import OtlpHttpReceiver
from tests.telemetry.test_otlp_metrics import (
    PER_REQUEST,
    Figures,
    Shape,
    assert_same_figures,
    figures_from_prometheus,
    figures_from_proto,
)

pytestmark = pytest.mark.timeout(180)

HOST = "127.0.0.1"
DEADLINE_S = 60.0
NUM_REQUESTS = 6
MAX_TOKENS = 40


class MetricsCollector:
    """Every ``ExportMetricsServiceRequest`` received, in order (both transports feed it)."""

    def __init__(self) -> None:
        self._requests: list[ExportMetricsServiceRequest] = []
        self._lock = threading.Lock()

    def add(self, request: ExportMetricsServiceRequest) -> None:
        with self._lock:
            self._requests.append(request)

    def snapshot(self) -> list[ExportMetricsServiceRequest]:
        with self._lock:
            return list(self._requests)

    def wait_for(
        self, predicate: Callable[[list[ExportMetricsServiceRequest]], bool], timeout_s: float
    ) -> list[ExportMetricsServiceRequest]:
        deadline = time.monotonic() + timeout_s
        while not predicate(received := self.snapshot()):
            assert time.monotonic() < deadline, f"collector: {len(received)} exports, condition not met"
            time.sleep(0.05)  # polling under a deadline
        return received


@contextmanager
def http_collector(collector: MetricsCollector) -> Iterator[str]:
    receiver = OtlpHttpReceiver(
        "/v1/metrics", ExportMetricsServiceRequest, ExportMetricsServiceResponse(), collector.add
    )
    try:
        yield f"{receiver.base_url}/v1/metrics"
    finally:
        receiver.close()


@contextmanager
def grpc_collector(collector: MetricsCollector) -> Iterator[str]:
    class Service(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(
            self, request: ExportMetricsServiceRequest, context: grpc.ServicerContext
        ) -> ExportMetricsServiceResponse:
            collector.add(request)
            return ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port(f"{HOST}:0")
    server.start()
    try:
        yield f"http://{HOST}:{port}"
    finally:
        server.stop(grace=None)


def total(figures: Figures, name: str) -> float:
    return sum(v for v in figures.get(name, {}).values() if isinstance(v, float))


async def traffic(base_url: str) -> list[int]:
    async with httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S) as client:

        async def one(i: int) -> int:
            body = {"model": "mock", "prompt": f"request {i} " * 20, "max_tokens": MAX_TOKENS,
                    "stream": i % 2 == 0, "ignore_eos": True}  # fmt: skip
            tier = ("interactive", "standard", "batch")[i % 3]
            response = await client.post("/v1/completions", json=body, headers={"x-sla-tier": tier})
            return response.status_code

        return list(await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS))))


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_the_gateway_pushes_what_metrics_shows(
    protocol: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = MetricsCollector()
    receiver = http_collector if protocol == "http/protobuf" else grpc_collector
    with receiver(collector) as endpoint:
        for name in (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_RESOURCE_ATTRIBUTES",
        ):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "tierserve-metrics-e2e")
        with running_server(["--mock", "1"], tmp_path / "serve.log", ready_timeout_s=60) as server:
            assert asyncio.run(traffic(server.base_url)) == [200] * NUM_REQUESTS
            deadline = time.monotonic() + DEADLINE_S
            while total(figures_from_prometheus(httpx.get(f"{server.base_url}/metrics").text),
                        "tierserve.requests") < NUM_REQUESTS:  # fmt: skip
                assert time.monotonic() < deadline, "the requests never all counted"
                time.sleep(0.05)  # polling under a deadline
            scraped = figures_from_prometheus(httpx.get(f"{server.base_url}/metrics").text)
            seen = len(collector.snapshot())
            received = collector.wait_for(lambda r: len(r) >= seen + 2, DEADLINE_S)  # both after the scrape
            pid = server.process.pid
    resource, got, shapes = next(figures_from_proto(received[-1]))
    assert resource["service.name"] == "tierserve-metrics-e2e"
    assert resource["tierserve.component"] == "gateway" and resource["process.pid"] == pid
    for request in received:  # the workers have no meter of their own: only the gateway exports
        for other, _, _ in figures_from_proto(request):
            assert other["tierserve.component"] == "gateway"
    assert_same_figures(scraped, got, [OTLP[name].name for name in PER_REQUEST])
    assert total(got, "tierserve.requests") == NUM_REQUESTS
    assert total(got, "tierserve.output_tokens") == NUM_REQUESTS * MAX_TOKENS
    for instrument in OTLP.values():
        if scraped.get(instrument.name):  # a series exists: it is exported
            assert set(got[instrument.name]) == set(scraped[instrument.name]), instrument.name
            assert shapes[instrument.name] == Shape(instrument.unit, instrument.kind), instrument.name
    worker = frozenset({"tierserve.worker": "mock-0", "gen_ai.response.model": "mock"}.items())
    assert (
        got["tierserve.worker.kv_blocks_total"][worker] == scraped["tierserve.worker.kv_blocks_total"][worker]
    )
