"""The gateway's metrics through an OpenTelemetry meter: the figures ``/metrics`` shows, under the names
and units in gateway/instruments.py's ``OTLP`` table, read by the SDK's in-memory reader.

``figures_from_prometheus`` / ``figures_from_sdk`` / ``figures_from_proto`` bring the three shapes (the
Prometheus text, the SDK's MetricsData, an OTLP ExportMetricsServiceRequest) to one comparable form;
tests/e2e/test_otlp_metrics.py uses them with a real ``serve`` process.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    InMemoryMetricReader,
    MetricsData,
)
from opentelemetry.sdk.metrics.export import Gauge as SdkGauge
from opentelemetry.sdk.metrics.export import Histogram as SdkHistogram
from opentelemetry.sdk.metrics.export import Sum as SdkSum
from opentelemetry.sdk.resources import Resource
from prometheus_client.parser import text_string_to_metric_families

from gateway.instruments import OTLP, GatewayMetrics
from gateway.metrics import Histogram
from telemetry import Telemetry
from telemetry.metrics_bridge import Instrument, LoopReader, publish_series
from telemetry.setup import INSTRUMENTATION_NAME
from tests.telemetry.test_spans import NUM_KV_BLOCKS, NUM_OUTPUT, run_traffic

Attributes = frozenset[tuple[str, object]]
GEN_AI_HISTOGRAMS = {
    "gen_ai.server.time_to_first_token": "tierserve_time_to_first_token_seconds",
    "gen_ai.server.time_per_output_token": "tierserve_time_per_output_token_seconds",
    "gen_ai.server.request.duration": "tierserve_e2e_request_latency_seconds",
}
DECLARED = {metric.name: metric for metric in GatewayMetrics().registry}
PER_REQUEST = [name for name, m in DECLARED.items() if m.label_names[:2] == ("model", "tier")]


@dataclass(frozen=True, slots=True)
class HistogramFigure:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket, not cumulative; the last one is above the last bound
    sum: float
    count: int


Figure = float | HistogramFigure
Figures = dict[str, dict[Attributes, Figure]]  # OTLP name → attributes → figure


@dataclass(frozen=True, slots=True)
class Shape:
    unit: str
    kind: str  # counter, updowncounter, gauge, histogram


def prometheus_name(instrument: Instrument) -> str:
    """OpenTelemetry's translation to a Prometheus name: dots to underscores, the unit's suffix (``s``:
    ``_seconds``, ``1`` on a gauge: ``_ratio``; ``{annotations}`` add nothing), ``_total`` on counters."""
    name = instrument.name.replace(".", "_")
    suffix = {"s": "_seconds", "1": "_ratio"}.get(instrument.unit, "")
    if not name.endswith(suffix):
        name += suffix
    return name + "_total" if instrument.kind == "counter" else name


def figures_from_prometheus(text: str) -> Figures:
    """``/metrics`` parsed by prometheus_client, keyed like OTLP (our labels → their attributes)."""
    figures: Figures = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        instrument, label_names = OTLP[name], DECLARED[name].label_names
        series = figures.setdefault(instrument.name, {})

        def attributes(
            labels: dict[str, str], names: tuple[str, ...] = label_names, of: Instrument = instrument
        ) -> Attributes:
            return frozenset(of.attributes_of(tuple(labels[n] for n in names)).items())

        if family.type != "histogram":
            for sample in family.samples:
                series[attributes(sample.labels)] = float(sample.value)
            continue
        buckets: dict[Attributes, dict[float, float]] = {}
        sums: dict[Attributes, float] = {}
        for sample in family.samples:
            key = attributes(sample.labels)
            if sample.name.endswith("_bucket"):
                buckets.setdefault(key, {})[float(sample.labels["le"])] = sample.value
            elif sample.name.endswith("_sum"):
                sums[key] = sample.value
        for key, cumulative in buckets.items():
            bounds = sorted(cumulative)
            totals = [int(cumulative[b]) for b in bounds]
            counts = [b - a for a, b in zip([0, *totals], totals, strict=False)]
            series[key] = HistogramFigure(tuple(bounds[:-1]), tuple(counts), sums[key], totals[-1])
    return figures


def figures_from_sdk(data: MetricsData | None) -> tuple[Figures, dict[str, Shape]]:
    figures: Figures = {}
    shapes: dict[str, Shape] = {}
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                series = figures.setdefault(metric.name, {})
                points = metric.data.data_points
                if isinstance(metric.data, SdkHistogram):
                    kind = "histogram"
                    assert metric.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
                elif isinstance(metric.data, SdkSum):
                    kind = "counter" if metric.data.is_monotonic else "updowncounter"
                    assert metric.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
                else:
                    assert isinstance(metric.data, SdkGauge)
                    kind = "gauge"
                shapes[metric.name] = Shape(metric.unit or "", kind)
                for point in points:
                    key = frozenset((point.attributes or {}).items())
                    if kind == "histogram":
                        bounds, counts = tuple(point.explicit_bounds), tuple(point.bucket_counts)  # type: ignore[union-attr]
                        series[key] = HistogramFigure(bounds, counts, point.sum, point.count)  # type: ignore[union-attr]
                    else:
                        series[key] = float(point.value)  # type: ignore[union-attr]
    return figures, shapes


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind is not None else None


def figures_from_proto(
    request: ExportMetricsServiceRequest,
) -> Iterator[tuple[dict[str, object], Figures, dict[str, Shape]]]:
    """(resource attributes, figures, shapes) for each resource in one OTLP export."""
    cumulative = 2  # the proto's AGGREGATION_TEMPORALITY_CUMULATIVE
    for resource_metrics in request.resource_metrics:
        resource = {kv.key: _value(kv.value) for kv in resource_metrics.resource.attributes}
        figures: Figures = {}
        shapes: dict[str, Shape] = {}
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                series = figures.setdefault(metric.name, {})
                data = metric.WhichOneof("data")
                if data == "histogram":
                    kind = "histogram"
                    assert metric.histogram.aggregation_temporality == cumulative
                    for h in metric.histogram.data_points:
                        key = frozenset((kv.key, _value(kv.value)) for kv in h.attributes)
                        series[key] = HistogramFigure(tuple(h.explicit_bounds), tuple(h.bucket_counts), h.sum,
                                                      h.count)  # fmt: skip
                else:
                    assert data in ("sum", "gauge"), data
                    if data == "sum":
                        kind = "counter" if metric.sum.is_monotonic else "updowncounter"
                        assert metric.sum.aggregation_temporality == cumulative
                    else:
                        kind = "gauge"
                    for p in getattr(metric, data).data_points:
                        key = frozenset((kv.key, _value(kv.value)) for kv in p.attributes)
                        number = p.WhichOneof("value")
                        series[key] = float(getattr(p, number))
                shapes[metric.name] = Shape(metric.unit, kind)
        yield resource, figures, shapes


def assert_same_figures(expected: Figures, got: Figures, names: Iterable[str]) -> None:
    """For each OTLP name in ``names``: the same series and values (histograms: bounds, counts, sum)."""
    for name in names:
        assert got.get(name, {}) == expected.get(name, {}), name


def metered() -> tuple[InMemoryMetricReader, Telemetry]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "t"}))
    meter = provider.get_meter(INSTRUMENTATION_NAME)
    return reader, Telemetry(trace.NoOpTracer(), enabled=False, meter_provider=provider, meter=meter)


def record_some(metrics: GatewayMetrics) -> None:
    """A little of everything, by hand: what completion.py and the scrape-time collectors would do."""
    for tier, status, ttft in (("interactive", "200", 0.2), ("batch", "200", 3.0), ("batch", "499", 0.0)):
        labels = ("mock", tier)
        metrics.requests.inc(*labels, status)
        if status == "200":
            metrics.ttft.observe(*labels, value=ttft)
            metrics.tpot.observe(*labels, value=ttft / 100)
            metrics.e2e.observe(*labels, value=ttft + 1.5)
            metrics.prompt_tokens.inc(*labels, amount=40)
            metrics.output_tokens.inc(*labels, amount=100)
            metrics.cached_tokens.inc(*labels, amount=16)
        for gap in (0.004, 0.005, 0.02, 0.5):
            metrics.itl.observe(*labels, value=gap)
        metrics.queue_time.observe(*labels, value=0.0)
    metrics.shed.inc("mock", "batch")
    metrics.degraded.inc("big", "standard")
    metrics.queue_length.set("mock", "batch", value=2)
    metrics.seats_in_use.set("mock", value=5)
    metrics.worker_up.set("mock-0", "mock", "ready", value=1)
    metrics.worker_up.set("mock-0", "mock", "dead", value=0)
    metrics.worker_step_time.set("mock-0", "mock", value=0.005)
    metrics.worker_hit_ratio.set("mock-0", "mock", value=0.25)
    metrics.quant_layer_error.set("mock-0", "mock", "layers.0.qkv_proj", value=3e-5)
    metrics.tier_feasible.set("mock", "interactive", value=1.0)
    for gauge, value in ((metrics.worker_running, 2), (metrics.worker_waiting, 1),
                         (metrics.worker_used_blocks, 30), (metrics.worker_free_blocks, 482),
                         (metrics.worker_total_blocks, 512), (metrics.index_blocks, 40)):  # fmt: skip
        gauge.set("mock-0", "mock", value=value)
    worker_totals = ((metrics.worker_preemptions, 3), (metrics.worker_evictions, 7),
                     (metrics.worker_prefix_queries, 400), (metrics.worker_prefix_hits, 100),
                     (metrics.index_resyncs, 1))  # fmt: skip
    for counter, total in worker_totals:
        counter.set_total("mock-0", "mock", total=total)
    metrics.frames_dropped.set_total("stale", total=2)
    metrics.workers_lost.set_total(total=1)
    metrics.migrations.set_total("mock", total=1)


def test_every_metric_has_an_otlp_twin_of_its_kind() -> None:
    assert set(OTLP) == set(DECLARED)
    for name, metric in DECLARED.items():
        instrument = OTLP[name]
        assert instrument.kind == metric.kind or (metric.kind, instrument.kind) == ("gauge", "updowncounter")
        assert len(instrument.attributes) == len(metric.label_names), name
        if instrument.name.startswith("gen_ai."):  # the GenAI semantic conventions' own names
            assert GEN_AI_HISTOGRAMS[instrument.name] == name and instrument.unit == "s"
        else:  # ours translate back to the Prometheus name exactly
            assert instrument.name.startswith("tierserve.") and prometheus_name(instrument) == name
    assert len({i.name for i in OTLP.values()}) == len(OTLP)


def test_the_in_memory_reader_sees_what_metrics_shows() -> None:
    reader, telemetry = metered()
    metrics = GatewayMetrics()
    metrics.export(telemetry)
    record_some(metrics)
    got, shapes = figures_from_sdk(reader.get_metrics_data())
    expected = figures_from_prometheus(metrics.registry.render())
    assert_same_figures(expected, got, [i.name for i in OTLP.values()])
    assert shapes == {i.name: Shape(i.unit, i.kind) for i in OTLP.values() if i.name in got}
    for instrument in OTLP.values():  # everything recorded above is there, under its attributes
        assert got.get(instrument.name), instrument.name
    status = {dict(key)["http.response.status_code"] for key in got["tierserve.requests"]}
    assert status == {200, 499}  # an integer, as the HTTP conventions have it
    ttft = got["gen_ai.server.time_to_first_token"]
    key = frozenset({"gen_ai.response.model": "mock", "tierserve.tier": "batch"}.items())
    batch_ttft = ttft[key]
    assert isinstance(batch_ttft, HistogramFigure) and batch_ttft.bounds == metrics.ttft.buckets
    assert (
        frozenset({"gen_ai.request.model": "big", "tierserve.tier": "standard"}.items())
        in (got["tierserve.degraded"])
    )  # the model asked for
    metrics.requests.inc("mock", "batch", "200")  # observable: the next read sees the registry now
    again, _ = figures_from_sdk(reader.get_metrics_data())
    batch_200 = frozenset({**dict(key), "http.response.status_code": 200}.items())
    assert again["tierserve.requests"][batch_200] == 2.0


def test_off_publishes_nothing() -> None:
    metrics = GatewayMetrics()
    metrics.export(Telemetry.off())
    assert all(not m.sinks for m in metrics.registry if isinstance(m, Histogram))


def test_the_exporters_thread_reads_the_registry_on_its_event_loop() -> None:
    """The reader runs in another thread than the loop that owns the registry: the collectors (which walk
    the dispatcher and admission) run on the loop, never concurrently with it."""
    reader, telemetry = metered()
    built: list[GatewayMetrics] = []
    collected_on: list[int] = []
    ready, stop = threading.Event(), threading.Event()

    async def owner() -> None:
        metrics = GatewayMetrics()
        metrics.registry.on_collect(lambda: collected_on.append(threading.get_ident()))
        metrics.export(telemetry)
        metrics.requests.inc("mock", "standard", "200")
        built.append(metrics)
        ready.set()
        await asyncio.to_thread(stop.wait)

    loop_thread = threading.Thread(target=asyncio.run, args=(owner(),))
    loop_thread.start()
    try:
        assert ready.wait(30)
        got, _ = figures_from_sdk(reader.get_metrics_data())
    finally:
        stop.set()
        loop_thread.join(30)
    assert collected_on and set(collected_on) == {loop_thread.ident}
    assert list(got["tierserve.requests"].values()) == [1.0]
    # The loop is gone (shutdown's last export): the registry is read directly, nobody else touches it.
    collected_on.clear()
    after, _ = figures_from_sdk(reader.get_metrics_data())
    assert (
        set(collected_on) == {threading.get_ident()}
        and after["tierserve.requests"] == got["tierserve.requests"]
    )


def test_a_busy_loop_costs_the_export_its_observed_figures_not_a_thread() -> None:
    loop = asyncio.new_event_loop()
    release = threading.Event()
    loop.call_soon(release.wait)  # the loop's thread is stuck until the test lets it go
    loop_thread = threading.Thread(target=loop.run_forever)
    loop_thread.start()
    try:
        assert LoopReader(loop, timeout_s=0.05)(lambda: {("a",): 1.0}) == {}
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(30)
        loop.close()
    assert LoopReader(loop)(lambda: {("a",): 1.0}) == {("a",): 1.0}  # closed: read directly


def test_a_histogram_cannot_be_observed_and_kinds_are_checked() -> None:
    _, telemetry = metered()
    with pytest.raises(ValueError, match="cannot be observed"):
        publish_series(telemetry.meter, Instrument("x", "s", "histogram"), "x", dict, LoopReader(None))
    with pytest.raises(ValueError, match="kind"):
        Instrument("x", "s", "summary")


def test_a_real_gateway_and_worker_report_the_same_figures_both_ways() -> None:
    """tests/telemetry/test_spans.py's traffic (a real WorkerDaemon over a mock engine, a forced
    preemption): what the reader collects equals the /metrics scraped at the end, series for series."""
    reader, telemetry = metered()
    responses, _ = run_traffic(telemetry)  # two completions of NUM_OUTPUT tokens, a chat of 3, /metrics
    scraped = figures_from_prometheus(responses[-1].text)
    got, _ = figures_from_sdk(reader.get_metrics_data())
    assert_same_figures(scraped, got, [OTLP[name].name for name in PER_REQUEST])
    standard = frozenset({"gen_ai.response.model": "mock", "tierserve.tier": "standard"}.items())
    assert got["tierserve.requests"] == {frozenset({*standard, ("http.response.status_code", 200)}): 3.0}
    assert got["tierserve.output_tokens"][standard] == 2 * NUM_OUTPUT + 3
    itl = got["tierserve.inter_token_latency"][standard]
    assert isinstance(itl, HistogramFigure) and itl.count == 2 * (NUM_OUTPUT - 1) + (3 - 1)  # one a step
    worker = frozenset({"tierserve.worker": "mock-0", "gen_ai.response.model": "mock"}.items())
    for name in ("tierserve.worker.kv_blocks_total", "tierserve.worker.preemptions",
                 "tierserve.worker.kv_evictions", "tierserve.worker.prefix_cache_queries"):  # fmt: skip
        assert worker in got[name], name
    assert got["tierserve.worker.kv_blocks_total"][worker] == NUM_KV_BLOCKS
