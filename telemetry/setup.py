"""Tracer and meter providers from the standard ``OTEL_*`` variables, or nothing at all.

    no exporter configured ─▶ Telemetry.off(): the API's no-op tracer, no provider, no thread, no socket
    OTEL_TRACES_EXPORTER=otlp|console, or an OTLP endpoint ─▶ TracerProvider + BatchSpanProcessor
    OTEL_METRICS_EXPORTER=otlp|console, or an OTLP endpoint ─▶ MeterProvider + PeriodicExportingMetricReader
                                                              (``prometheus``: off, /metrics is always served)

What the SDK reads by itself, and so works as its documentation says: ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` (the resource), ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``
(default ``parentbased_always_on``), ``OTEL_BSP_*`` (batching), ``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]``
``ENDPOINT``, ``_HEADERS``, ``_TIMEOUT``, ``_COMPRESSION``, ``OTEL_METRIC_EXPORT_INTERVAL`` (ms, default
60000) and ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE`` (default cumulative). What we decide
here: whether each signal is on at all (the spec's default exporter is ``otlp``, but a server that
nobody pointed at a collector must not spend a thread and a socket retrying ``localhost:4318``), and
the protocol of each (``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]PROTOCOL``: ``http/protobuf``, the default,
or ``grpc``). Both signals share one resource.

Providers are not installed globally: the handle carries its tracer, so tests build as many as they like.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from opentelemetry import metrics, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

log = logging.getLogger(__name__)

INSTRUMENTATION_NAME = "tierserve"
CAPTURE_CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
PROTOCOLS = ("http/protobuf", "grpc")
_TRUE = ("1", "true", "yes", "on")


class TelemetryConfigError(ValueError):
    """An ``OTEL_*`` variable we cannot honour; the message names it."""


@dataclass(slots=True)
class Telemetry:
    """What a process traces with: ``tracer`` (a no-op one when off) and whether content may be recorded.

    ``enabled`` is False exactly when ``tracer`` is the API's no-op tracer: callers that would build
    per-request state for spans check it once per request (never per token) and otherwise do nothing.
    """

    tracer: trace.Tracer
    enabled: bool
    capture_content: bool = False  # prompt/completion text in attributes: only by explicit opt-in
    traces_exporter: str = "off"  # "otlp:http/protobuf", "otlp:grpc", "console" or "off"
    metrics_exporter: str = "off"
    tracer_provider: TracerProvider | None = None
    meter_provider: metrics.MeterProvider | None = None
    meter: metrics.Meter = field(default_factory=lambda: metrics.NoOpMeter(INSTRUMENTATION_NAME))

    @classmethod
    def off(cls) -> Telemetry:
        return cls(trace.NoOpTracer(), enabled=False)

    @classmethod
    def from_provider(cls, provider: TracerProvider, *, capture_content: bool = False) -> Telemetry:
        """Tracing through ``provider`` (tests: one with an in-memory exporter)."""
        return cls(
            provider.get_tracer(INSTRUMENTATION_NAME),
            enabled=True,
            capture_content=capture_content,
            tracer_provider=provider,
        )

    def shutdown(self) -> None:
        """Flush what is batched and stop the exporters' threads (idempotent)."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
            self.tracer_provider = None
        shutdown = getattr(self.meter_provider, "shutdown", None)
        if shutdown is not None:
            shutdown()
            self.meter_provider = None


def configure(
    default_service_name: str, component: str, environ: Mapping[str, str] | None = None
) -> Telemetry:
    """Providers from the ``OTEL_*`` variables; :meth:`Telemetry.off` when no exporter is configured.

    ``default_service_name`` is used when neither ``OTEL_SERVICE_NAME`` nor a ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES`` says otherwise; ``component`` ("gateway", "worker") becomes the
    ``tierserve.component`` resource attribute. Raises :class:`TelemetryConfigError` naming a bad variable.
    """
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return Telemetry.off()
    traces_exporter = _exporter_choice(env, "TRACES")
    metrics_exporter = _exporter_choice(env, "METRICS")
    if traces_exporter is None and metrics_exporter is None:
        return Telemetry.off()
    resource = _resource(default_service_name, component)
    telemetry = Telemetry.off()
    telemetry.capture_content = env.get(CAPTURE_CONTENT_ENV, "").strip().lower() in _TRUE
    if traces_exporter is not None:
        provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
        provider.add_span_processor(BatchSpanProcessor(_span_exporter(traces_exporter)))
        telemetry.tracer_provider = provider
        telemetry.tracer = provider.get_tracer(INSTRUMENTATION_NAME)
        telemetry.enabled = True
        telemetry.traces_exporter = traces_exporter
    if metrics_exporter is not None:
        meter_provider = _meter_provider(metrics_exporter, resource)
        telemetry.meter_provider = meter_provider
        telemetry.meter = meter_provider.get_meter(INSTRUMENTATION_NAME)
        telemetry.metrics_exporter = metrics_exporter
    log.info(
        "telemetry: traces %s, metrics %s, service %s",
        traces_exporter or "off",
        metrics_exporter or "off",
        resource.attributes.get(SERVICE_NAME),
    )
    return telemetry


def _exporter_choice(env: Mapping[str, str], signal: str) -> str | None:
    """``otlp:<protocol>``, ``console`` or None (off) for ``signal`` ("TRACES" or "METRICS")."""
    named = env.get(f"OTEL_{signal}_EXPORTER", "").strip().lower()
    endpoint = env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    has_endpoint = bool(endpoint)
    if named == "none" or (not named and not has_endpoint):
        return None
    if signal == "METRICS" and named == "prometheus":
        return None  # the gateway serves /metrics whatever this says; nothing to push
    if named == "console":
        return "console"
    if named not in ("", "otlp"):
        also = ", prometheus" if signal == "METRICS" else ""
        raise TelemetryConfigError(f"OTEL_{signal}_EXPORTER={named!r}: expected otlp, console{also} or none")
    key = f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL"
    protocol = (env.get(key) or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    if protocol not in PROTOCOLS:
        name = key if env.get(key) else "OTEL_EXPORTER_OTLP_PROTOCOL"
        raise TelemetryConfigError(f"{name}={protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    return f"otlp:{protocol}"


def _resource(default_service_name: str, component: str) -> Resource:
    resource = Resource.create({"tierserve.component": component, "process.pid": os.getpid()})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    return resource


def _span_exporter(choice: str) -> SpanExporter:
    if choice == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if choice == "otlp:grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()  # endpoint, headers, timeout and compression from OTEL_EXPORTER_OTLP_*


def _meter_provider(choice: str, resource: Resource) -> metrics.MeterProvider:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        MetricExporter,
        PeriodicExportingMetricReader,
    )

    exporter: MetricExporter
    if choice == "console":
        exporter = ConsoleMetricExporter()
    elif choice == "otlp:grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

        exporter = Grpc()
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

        exporter = Http()
    return MeterProvider(resource=resource, metric_readers=[PeriodicExportingMetricReader(exporter)])
