"""W3C trace context (``traceparent`` / ``tracestate``) in and out of plain string maps.

The gateway injects the dispatch span's context into ``Submit.trace_context``; the worker extracts it
so its spans join the same trace. Only the W3C trace context travels: no baggage, so nothing a client
put in a ``baggage`` header (nor any prompt text) ever reaches a worker this way.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def inject(span: trace.Span) -> dict[str, str]:
    """The W3C headers that make a remote span a child of ``span``; empty for a no-op/invalid span."""
    if not span.get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract(carrier: Mapping[str, str]) -> Context | None:
    """The remote parent carried in ``carrier`` (case-insensitive keys), or None when it holds none."""
    lowered = {key.lower(): value for key, value in carrier.items()}
    context = _PROPAGATOR.extract(lowered)
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context
