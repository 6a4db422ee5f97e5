"""The Prometheus text the gateway's /metrics serves: format, cumulative buckets, escaping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.metrics import Registry


def parse(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_counter_gauge_histogram_render_as_prometheus_text() -> None:
    registry = Registry()
    requests = registry.counter("t_requests_total", "Requests.", ("tier", "status"))
    queue = registry.gauge("t_queue_length", "Waiting.", ("tier",))
    latency = registry.histogram("t_latency_seconds", "Latency.", ("tier",), buckets=(0.1, 1.0))
    requests.inc("batch", "200")
    requests.inc("batch", "200", amount=2)
    queue.set("interactive", value=3)
    for value in (0.05, 0.5, 0.7, 5.0):
        latency.observe("batch", value=value)
    text = registry.render()
    assert "# TYPE t_requests_total counter" in text and "# TYPE t_latency_seconds histogram" in text
    samples = parse(text)
    assert samples['t_requests_total{tier="batch",status="200"}'] == 3
    assert samples['t_queue_length{tier="interactive"}'] == 3
    assert samples['t_latency_seconds_bucket{tier="batch",le="0.1"}'] == 1
    assert samples['t_latency_seconds_bucket{tier="batch",le="1"}'] == 3
    assert samples['t_latency_seconds_bucket{tier="batch",le="+Inf"}'] == 4
    assert samples['t_latency_seconds_count{tier="batch"}'] == 4
    assert samples['t_latency_seconds_sum{tier="batch"}'] == pytest.approx(6.25)


def test_label_values_are_escaped_and_label_counts_checked() -> None:
    registry = Registry()
    counter = registry.counter("t_total", "x", ("worker",))
    counter.inc('we"ird\\name\n')
    assert 't_total{worker="we\\"ird\\\\name\\n"} 1' in registry.render()
    with pytest.raises(ValueError, match="expected labels"):
        counter.inc("a", "b")
    with pytest.raises(ValueError, match="twice"):
        registry.counter("t_total", "again")


def test_collectors_refresh_gauges_at_render_time() -> None:
    registry = Registry()
    gauge = registry.gauge("t_workers", "Workers.", ("worker",))
    live = {"w0": 1.0}

    def collect() -> None:
        gauge.clear()
        for name, value in live.items():
            gauge.set(name, value=value)

    registry.on_collect(collect)
    assert parse(registry.render()) == {'t_workers{worker="w0"}': 1.0}
    live.pop("w0")
    live["w1"] = 2.0
    assert parse(registry.render()) == {'t_workers{worker="w1"}': 2.0}


@given(st.lists(st.floats(min_value=0, max_value=200, allow_nan=False), max_size=50))
def test_a_histogram_bucket_counts_every_value_at_or_below_its_bound(values: list[float]) -> None:
    registry = Registry()
    latency = registry.histogram("t_seconds", "x", ("tier",), buckets=(0.1, 1.0, 1.0 + 1e-9, 10.0))
    for value in values:
        latency.observe("a", value=value)
    if not values:
        assert "t_seconds_bucket" not in registry.render()
        return
    samples = parse(registry.render())
    for bound in ("0.1", "1", "1.000000001", "10"):
        expected = sum(value <= float(bound) for value in values)
        assert samples[f't_seconds_bucket{{tier="a",le="{bound}"}}'] == expected
    assert (
        samples['t_seconds_bucket{tier="a",le="+Inf"}'] == samples['t_seconds_count{tier="a"}'] == len(values)
    )


def test_sinks_see_every_later_observation_and_counters_can_exist_at_zero() -> None:
    registry = Registry()
    latency = registry.histogram("t_seconds", "x", ("tier",))
    shed = registry.counter("t_shed_total", "x", ("tier",))
    latency.observe("a", value=1.0)
    seen: list[tuple[tuple[str, ...], float]] = []
    latency.add_sink(lambda labels, value: seen.append((labels, value)))
    latency.observe("b", value=2.0)
    assert seen == [(("b",), 2.0)] and latency.count("a") == latency.count("b") == 1
    shed.ensure("a")
    shed.inc("b")
    shed.ensure("b")  # never lowers a series that exists
    assert shed.values() == {("a",): 0.0, ("b",): 1.0}
    assert 't_shed_total{tier="a"} 0' in registry.render()
