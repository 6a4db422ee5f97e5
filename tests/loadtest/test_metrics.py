"""Metric math against hand-computed fixtures (vLLM's benchmark definitions)."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.metrics import (
    LatencyStats,
    e2e_s,
    itls_s,
    meets_slo,
    percentile,
    summarize,
    timeline,
    tpot_s,
    ttft_s,
)
from loadtest.records import Outcome, RequestRecord
from wire.tier import Tier

TIERS = {
    "interactive": Tier(name="interactive", rank=0, ttft_ms=1000.0, tpot_ms=100.0),
    "standard": Tier(name="standard", rank=1, ttft_ms=3000.0, tpot_ms=200.0),
    "batch": Tier(name="batch", rank=2, deadline_s=2.0),
}


def record(
    tier: str = "standard",
    t_sent: float = 0.0,
    chunks: list[float] | None = None,
    t_end: float | None = None,
    num_out: int | None = None,
    outcome: Outcome = Outcome.OK,
    index: int = 0,
) -> RequestRecord:
    chunk_times = chunks or []
    return RequestRecord(
        index=index,
        target="base",
        tier=tier,
        expected_prompt_tokens=10,
        max_tokens=16,
        t_sent=t_sent,
        t_end=t_end if t_end is not None else (chunk_times[-1] if chunk_times else t_sent),
        chunk_times=chunk_times,
        outcome=outcome,
        num_prompt_tokens=10 if outcome is Outcome.OK else None,
        num_output_tokens=num_out,
    )


def steady(tier: str, t_sent: float, ttft: float, tpot: float, n: int, **kw: object) -> RequestRecord:
    """n tokens, one per chunk: the first at t_sent + ttft, then every tpot seconds."""
    chunks = [t_sent + ttft + k * tpot for k in range(n)]
    return record(tier, t_sent, chunks, num_out=n, **kw)  # type: ignore[arg-type]


def test_per_request_figures_with_a_chunk_of_two_tokens() -> None:
    # 5 tokens in 4 text chunks (the third carried two); the usage chunk arrived at 1.2.
    r = record(t_sent=0.0, chunks=[0.5, 0.6, 0.8, 1.1], t_end=1.2, num_out=5)
    assert ttft_s(r) == pytest.approx(0.5)
    assert tpot_s(r) == pytest.approx((1.2 - 0.5) / 4)  # the first token excluded: n - 1 = 4
    assert itls_s(r) == pytest.approx([0.1, 0.2, 0.3])  # gaps between chunks, not tokens
    assert e2e_s(r) == pytest.approx(1.2)


def test_tpot_is_undefined_for_one_token_and_meets_any_tpot_target() -> None:
    r = record("interactive", t_sent=1.0, chunks=[1.2], t_end=1.25, num_out=1)
    assert tpot_s(r) is None
    assert itls_s(r) == []
    assert ttft_s(r) == pytest.approx(0.2)
    assert meets_slo(r, TIERS["interactive"])


def test_percentiles_interpolate_like_numpy() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    values = list(np.random.default_rng(0).exponential(size=101))
    for q in (0, 12.5, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_latency_stats_in_milliseconds() -> None:
    stats = LatencyStats.of_seconds([0.1, 0.2, 0.3, 0.4])
    assert (stats.count, stats.mean, stats.p50) == (4, pytest.approx(250.0), pytest.approx(250.0))
    assert LatencyStats.of_seconds([]) == LatencyStats(0, None, None, None, None)


def test_goodput_and_attainment_with_several_slos() -> None:
    records = [
        steady("interactive", 0.0, ttft=0.5, tpot=0.05, n=10),  # met
        steady("interactive", 0.0, ttft=1.5, tpot=0.05, n=10),  # TTFT over 1 s
        steady("interactive", 0.0, ttft=0.3, tpot=0.15, n=10),  # TPOT over 100 ms
        steady("interactive", 0.0, ttft=0.9, tpot=0.5, n=1),  # one token: only TTFT counts → met
        steady("standard", 0.0, ttft=2.0, tpot=0.15, n=5),  # met
        record("standard", 0.0, t_end=0.1, outcome=Outcome.HTTP_5XX),  # failed: never meets
        steady("batch", 0.0, ttft=1.0, tpot=0.1, n=6),  # E2E 1.5 s within the 2 s deadline → met
        steady("batch", 0.0, ttft=1.0, tpot=0.4, n=6),  # E2E 3.0 s → missed
    ]
    summary = summarize(records, TIERS, duration_s=4.0)
    assert list(summary.tiers) == ["interactive", "standard", "batch"]  # most urgent first
    assert summary.overall.num_slo_met == 4
    assert summary.overall.goodput_req_s == pytest.approx(1.0)
    assert summary.overall.slo_attainment == pytest.approx(4 / 8)
    assert summary.tiers["interactive"].slo_attainment == pytest.approx(2 / 4)
    assert summary.tiers["standard"].slo_attainment == pytest.approx(1 / 2)
    assert summary.tiers["batch"].goodput_req_s == pytest.approx(1 / 4)
    standard = summary.tiers["standard"]
    assert (standard.num_requests, standard.num_ok, standard.outcomes["http_5xx"]) == (2, 1, 1)
    assert standard.slo is not None and standard.slo.ttft_ms == 3000.0


def test_a_tier_without_targets_needs_only_success_and_an_unknown_tier_has_none() -> None:
    untargeted = Tier(name="bulk", rank=5)
    assert meets_slo(steady("bulk", 0.0, ttft=100.0, tpot=10.0, n=3), untargeted)
    assert meets_slo(steady("other", 0.0, ttft=100.0, tpot=10.0, n=3), None)
    assert not meets_slo(record("bulk", outcome=Outcome.TIMEOUT), untargeted)


def test_throughput_counts_only_successful_requests_over_the_duration() -> None:
    records = [
        steady("standard", 0.0, ttft=0.1, tpot=0.1, n=20),
        steady("standard", 0.5, ttft=0.1, tpot=0.1, n=10),
        record("standard", 0.2, t_end=0.3, outcome=Outcome.RATE_LIMITED),
    ]
    overall = summarize(records, TIERS, duration_s=2.0).overall
    assert overall.output_tok_s == pytest.approx(30 / 2.0)
    assert overall.total_tok_s == pytest.approx((30 + 20) / 2.0)  # 10 prompt tokens per ok request
    assert overall.request_s == pytest.approx(1.0)
    assert overall.outcomes == {
        "ok": 2, "http_4xx": 0, "http_429": 1, "http_5xx": 0, "timeout": 0, "transport_error": 0,
        "stream_error": 0,
    }  # fmt: skip
    assert overall.itl_ms.count == 19 + 9  # pooled over requests
    assert overall.tpot_ms.p50 == pytest.approx(100.0)


def test_timeline_spreads_tokens_over_chunks_and_counts_in_flight() -> None:
    records = [
        record(t_sent=0.0, chunks=[0.5, 1.5], t_end=1.6, num_out=4),  # 2 tokens per chunk
        record(t_sent=1.2, chunks=[2.5], t_end=2.6, num_out=3),
    ]
    line = timeline(records, bin_s=1.0)
    assert line.starts == [0.0, 1.0, 2.0]
    assert line.output_tok_s == pytest.approx([2.0, 2.0, 3.0])
    assert line.in_flight == [1, 2, 1]  # at 0.5, 1.5 and 2.5 s
