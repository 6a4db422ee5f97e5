"""telemetry.configure: the OTEL_* variables decide everything; no exporter configured means off."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME

from telemetry import Telemetry, TelemetryConfigError, configure, extract, inject

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT",
)
ENDPOINT = "http://127.0.0.1:9"  # nothing listens; nothing is exported in these tests


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


def configured(monkeypatch: pytest.MonkeyPatch, **env: str) -> Telemetry:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    telemetry = configure("tierserve", "gateway")
    return telemetry


def test_nothing_configured_is_off_with_the_no_op_tracer(monkeypatch: pytest.MonkeyPatch) -> None:
    telemetry = configured(monkeypatch)
    assert not telemetry.enabled and telemetry.tracer_provider is None and telemetry.meter_provider is None
    assert isinstance(telemetry.tracer, trace.NoOpTracer)
    span = telemetry.tracer.start_span("x")
    assert not span.is_recording() and inject(span) == {}


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT},
        {
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
        },
    ],
)
def test_disabled_wins_over_an_endpoint(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    assert not configured(monkeypatch, **env).enabled


def test_an_endpoint_turns_on_otlp_over_http_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    telemetry = configured(monkeypatch, OTEL_EXPORTER_OTLP_ENDPOINT=ENDPOINT)
    try:
        assert telemetry.enabled and telemetry.traces_exporter == "otlp:http/protobuf"
        assert telemetry.metrics_exporter == "otlp:http/protobuf"
        span = telemetry.tracer.start_span("x")
        assert span.is_recording()  # parentbased_always_on
        assert telemetry.tracer_provider is not None
        resource = telemetry.tracer_provider.resource.attributes
        assert resource[SERVICE_NAME] == "tierserve" and resource["tierserve.component"] == "gateway"
    finally:
        telemetry.shutdown()


def test_grpc_and_the_per_signal_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    telemetry = configured(
        monkeypatch,
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://127.0.0.1:9",
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="grpc",
        OTEL_SERVICE_NAME="my-llm",
        OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test",
    )
    try:
        assert telemetry.traces_exporter == "otlp:grpc" and telemetry.metrics_exporter == "off"
        assert telemetry.tracer_provider is not None
        resource = telemetry.tracer_provider.resource.attributes
        assert resource[SERVICE_NAME] == "my-llm" and resource["deployment.environment"] == "test"
    finally:
        telemetry.shutdown()


def test_metrics_alone_with_their_own_endpoint_and_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    telemetry = configured(
        monkeypatch,
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_METRICS_ENDPOINT="http://127.0.0.1:9",
        OTEL_EXPORTER_OTLP_METRICS_PROTOCOL="grpc",
        OTEL_SERVICE_NAME="my-llm",
    )
    try:
        assert telemetry.metrics_exporter == "otlp:grpc" and telemetry.traces_exporter == "off"
        assert not telemetry.enabled and isinstance(telemetry.tracer, trace.NoOpTracer)  # no tracing
        assert telemetry.meter_provider is not None
        resource = telemetry.meter_provider._sdk_config.resource.attributes  # type: ignore[attr-defined]
        assert resource[SERVICE_NAME] == "my-llm" and resource["tierserve.component"] == "gateway"
    finally:
        telemetry.shutdown()


def test_traces_and_metrics_share_one_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    telemetry = configured(monkeypatch, OTEL_EXPORTER_OTLP_ENDPOINT=ENDPOINT,
                           OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test")  # fmt: skip
    try:
        assert telemetry.tracer_provider is not None and telemetry.meter_provider is not None
        metrics_resource = telemetry.meter_provider._sdk_config.resource  # type: ignore[attr-defined]
        assert metrics_resource == telemetry.tracer_provider.resource
        assert metrics_resource.attributes["deployment.environment"] == "test"
    finally:
        telemetry.shutdown()


@pytest.mark.parametrize("exporter", ["none", "prometheus"])
def test_metrics_off_while_traces_go_out(monkeypatch: pytest.MonkeyPatch, exporter: str) -> None:
    """``prometheus``: the standard value for a pull exporter; /metrics is always served, nothing to push."""
    telemetry = configured(monkeypatch, OTEL_EXPORTER_OTLP_ENDPOINT=ENDPOINT, OTEL_METRICS_EXPORTER=exporter)
    try:
        assert telemetry.enabled and telemetry.meter_provider is None and telemetry.metrics_exporter == "off"
    finally:
        telemetry.shutdown()


def test_the_sampler_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    telemetry = configured(
        monkeypatch,
        OTEL_TRACES_EXPORTER="console",
        OTEL_TRACES_SAMPLER="traceidratio",
        OTEL_TRACES_SAMPLER_ARG="0",
    )
    try:
        assert telemetry.enabled and not telemetry.tracer.start_span("x").is_recording()
    finally:
        telemetry.shutdown()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
         "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"},
         "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
        ({"OTEL_METRICS_EXPORTER": "statsd"}, "OTEL_METRICS_EXPORTER"),
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "json"},
         "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"),
    ],
)  # fmt: skip
def test_what_we_cannot_honour_is_an_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    with pytest.raises(TelemetryConfigError, match=named):
        configured(monkeypatch, **env)


def test_content_capture_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = configured(monkeypatch, OTEL_TRACES_EXPORTER="console")
    opted = configured(monkeypatch, OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true")
    try:
        assert not plain.capture_content and opted.capture_content
    finally:
        plain.shutdown()
        opted.shutdown()


def test_w3c_context_round_trips_and_garbage_is_no_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    telemetry = configured(monkeypatch, OTEL_TRACES_EXPORTER="console")
    try:
        span = telemetry.tracer.start_span("parent")
        carrier = inject(span)
        assert set(carrier) == {"traceparent"}
        context = extract({"TraceParent": carrier["traceparent"]})
        assert context is not None
        remote = trace.get_current_span(context).get_span_context()
        assert remote.trace_id == span.get_span_context().trace_id and remote.is_remote
        assert extract({}) is None and extract({"traceparent": "00-zz-zz-01"}) is None
    finally:
        telemetry.shutdown()
