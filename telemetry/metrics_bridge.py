"""Figures kept elsewhere (a Prometheus-style registry), published through an OpenTelemetry meter.

    publish_series(meter, instrument, description, read)    counter / updowncounter / gauge: an
                                                             observable instrument; its callback calls
                                                             read() → {label values: value}
    histogram_sink(meter, instrument, description, bounds)  → sink(label values, value): an OpenTelemetry
                                                             histogram with those bucket bounds
    LoopReader(loop)                                        read() on the event loop that owns the figures

The meter's reader calls callbacks from its own thread (the periodic exporter's, every
``OTEL_METRIC_EXPORT_INTERVAL`` ms) while the figures belong to an asyncio loop that never locks them:
:class:`LoopReader` asks that loop to make the copy and waits for it, under a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry.metrics import CallbackOptions, Meter, Observation

LabelValues = tuple[str, ...]
Series = Mapping[LabelValues, float]
Attributes = dict[str, str | int]
KINDS = ("counter", "updowncounter", "gauge", "histogram")
INT_ATTRIBUTES = frozenset({"http.response.status_code"})  # integers in the semantic conventions
READ_TIMEOUT_S = 2.0  # a wedged event loop costs one export its observable figures, never a thread


@dataclass(frozen=True, slots=True)
class Instrument:
    """One figure as OpenTelemetry names it: ``name`` (dotted; no unit, no ``_total``), ``unit`` (UCUM:
    ``s``, ``1``, ``{token}``), ``kind`` (one of :data:`KINDS`) and one attribute name per label value.
    ``updowncounter`` is for counts that add up across series (queue lengths), ``gauge`` for the rest."""

    name: str
    unit: str
    kind: str
    attributes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r}, expected one of {', '.join(KINDS)}")

    def attributes_of(self, labels: LabelValues) -> Attributes:
        return {
            name: int(value) if name in INT_ATTRIBUTES and value.isdigit() else value
            for name, value in zip(self.attributes, labels, strict=True)
        }


class LoopReader:
    """Runs a read on ``loop`` (the figures' owner) for a caller on another thread, and waits for it.

    Reads directly when there is no loop (figures built outside one), when the loop is closed (the last
    export at shutdown: nothing else touches the figures any more) or when called on the loop's thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None, timeout_s: float = READ_TIMEOUT_S) -> None:
        self.loop = loop
        self.timeout_s = timeout_s

    def __call__(self, read: Callable[[], Series]) -> Series:
        loop = self.loop
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or loop.is_closed() or running is loop:
            return read()
        future: concurrent.futures.Future[Series] = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(read())
                except BaseException as exc:  # raised again in the waiting thread
                    future.set_exception(exc)

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # closed since the check above
            return read()
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return {}


def publish_series(
    meter: Meter, instrument: Instrument, description: str, read: Callable[[], Series], reader: LoopReader
) -> None:
    """An observable counter, up-down counter or gauge reporting ``read()`` (through ``reader``)."""

    def observe(options: CallbackOptions) -> Iterable[Observation]:
        values = reader(read)
        return [Observation(value, instrument.attributes_of(labels)) for labels, value in values.items()]

    create = {
        "counter": meter.create_observable_counter,
        "updowncounter": meter.create_observable_up_down_counter,
        "gauge": meter.create_observable_gauge,
    }.get(instrument.kind)
    if create is None:
        raise ValueError(f"{instrument.name}: a {instrument.kind} cannot be observed; see histogram_sink")
    create(instrument.name, [observe], instrument.unit, description)


def histogram_sink(
    meter: Meter, instrument: Instrument, description: str, bounds: Sequence[float]
) -> Callable[[LabelValues, float], None]:
    """``sink(labels, value)`` records into a histogram with explicit bucket ``bounds``."""
    histogram = meter.create_histogram(
        instrument.name, instrument.unit, description, explicit_bucket_boundaries_advisory=bounds
    )
    cache: dict[LabelValues, Attributes] = {}  # one attributes dict per series, not per observation

    def sink(labels: LabelValues, value: float) -> None:
        attributes = cache.get(labels)
        if attributes is None:
            attributes = cache[labels] = instrument.attributes_of(labels)
        histogram.record(value, attributes)

    return sink
