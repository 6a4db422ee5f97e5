"""The gateway's metrics, served on ``GET /metrics`` in the Prometheus text format (version 0.0.4).

Two kinds of figures:
  - measured here, per request, as it happens: counters and histograms in a :class:`Registry`
    (requests by tier and status, tokens, sheds, TTFT, TPOT, end-to-end latency, admission queue time);
  - reported by others and read at scrape time: gauges a ``collect`` callback writes just before the
    text is rendered (admission queue lengths, each worker's load and KV use from its last heartbeat,
    dispatcher drop counters).

Names follow the OpenTelemetry-to-Prometheus conventions: a ``tierserve_`` prefix, base units in the
name (``_seconds``), ``_total`` on counters. ``docs/observability.md`` lists them with example PromQL,
and the names gateway/instruments.py gives them when it exports the same figures over OTLP.
Deliberately small and dependency-free: one event loop owns it, so nothing here is locked (a reader on
another thread, the OTLP exporter's, asks that loop for a copy).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence

Labels = tuple[str, ...]

# Latency buckets (seconds): fine below a second, where interactive SLOs live, coarse above.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                   3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                         0.15, 0.2, 0.3, 0.5, 1.0, 2.5)  # fmt: skip


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{name}="{_escape(value)}"' for name, value in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str]) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(label_names)

    def _key(self, labels: Labels) -> Labels:
        if len(labels) != len(self.label_names):
            raise ValueError(f"{self.name}: expected labels {self.label_names}, got {labels}")
        return labels

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> Iterable[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, label_names)
        self._values: dict[Labels, float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def set_total(self, *labels: str, total: float) -> None:
        """For counters kept elsewhere (a worker's preemptions): copy the running total at scrape."""
        self._values[self._key(labels)] = total

    def ensure(self, *labels: str) -> None:
        """A series that exists at 0 before its first event, so ``rate()`` sees the first one."""
        self._values.setdefault(self._key(labels), 0.0)

    def values(self) -> dict[Labels, float]:
        """A copy: every series and its total."""
        return dict(self._values)

    def samples(self) -> Iterable[str]:
        for labels, value in sorted(self._values.items()):
            yield f"{self.name}{_format_labels(self.label_names, labels)} {_format_value(value)}"


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, label_names)
        self._values: dict[Labels, float] = {}

    def set(self, *labels: str, value: float) -> None:
        self._values[self._key(labels)] = value

    def value(self, *labels: str) -> float | None:
        return self._values.get(labels)

    def values(self) -> dict[Labels, float]:
        """A copy: every series and its value."""
        return dict(self._values)

    def clear(self) -> None:
        """Gauges written at scrape forget series that no longer exist (a removed worker)."""
        self._values.clear()

    def samples(self) -> Iterable[str]:
        for labels, value in sorted(self._values.items()):
            yield f"{self.name}{_format_labels(self.label_names, labels)} {_format_value(value)}"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, label_names: Sequence[str] = (), buckets: Sequence[float] = ()
    ) -> None:
        super().__init__(name, help_text, label_names)
        self.buckets = tuple(sorted(buckets or LATENCY_BUCKETS))
        self._counts: dict[Labels, list[int]] = {}  # per bucket, not cumulative; the last is +Inf
        self._sums: dict[Labels, float] = {}
        self._sinks: list[Callable[[Labels, float], None]] = []  # none unless OTLP export is on

    def add_sink(self, sink: Callable[[Labels, float], None]) -> None:
        """Every later observation is also handed to ``sink(labels, value)`` (an OpenTelemetry histogram)."""
        self._sinks.append(sink)

    @property
    def sinks(self) -> tuple[Callable[[Labels, float], None], ...]:
        return tuple(self._sinks)

    def observe(self, *labels: str, value: float) -> None:
        key = self._key(labels)
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = [0] * (len(self.buckets) + 1)
            self._sums[key] = 0.0
        counts[bisect_left(self.buckets, value)] += 1  # the first bound >= value: Prometheus' le
        self._sums[key] += value
        for sink in self._sinks:
            sink(key, value)

    def count(self, *labels: str) -> int:
        return sum(self._counts.get(labels, ()))

    def samples(self) -> Iterable[str]:
        for labels, counts in sorted(self._counts.items()):
            running = 0
            for bound, count in zip((*self.buckets, math.inf), counts, strict=True):
                running += count
                le = f'le="{_format_value(bound)}"'
                yield f"{self.name}_bucket{_format_labels(self.label_names, labels, le)} {running}"
            label_text = _format_labels(self.label_names, labels)
            yield f"{self.name}_sum{label_text} {_format_value(self._sums[labels])}"
            yield f"{self.name}_count{label_text} {running}"


class Registry:
    """Metrics by name plus callbacks that refresh scrape-time gauges; renders the exposition text."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._collectors: list[Callable[[], None]] = []

    def _add(self, metric: _Metric) -> None:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric

    def counter(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> Counter:
        metric = Counter(name, help_text, label_names)
        self._add(metric)
        return metric

    def gauge(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> Gauge:
        metric = Gauge(name, help_text, label_names)
        self._add(metric)
        return metric

    def histogram(
        self, name: str, help_text: str, label_names: Sequence[str] = (), buckets: Sequence[float] = ()
    ) -> Histogram:
        metric = Histogram(name, help_text, label_names, buckets)
        self._add(metric)
        return metric

    def __iter__(self) -> Iterator[_Metric]:
        return iter(self._metrics.values())

    def on_collect(self, callback: Callable[[], None]) -> None:
        self._collectors.append(callback)

    def collect(self) -> None:
        """Refresh the scrape-time figures (the ``on_collect`` callbacks)."""
        for collect in self._collectors:
            collect()

    def render(self) -> str:
        self.collect()
        lines: list[str] = []
        for metric in self._metrics.values():
            lines += metric.header()
            lines += metric.samples()
        return "\n".join(lines) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
