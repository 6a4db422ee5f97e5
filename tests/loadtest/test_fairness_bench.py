"""The ``fairness`` scenario's arguments and arithmetic on hand-made records (its processes are
exercised by ``tierserve bench fairness --mock``; tests/e2e/test_fairness.py holds the behaviour)."""

from __future__ import annotations

import pytest

from loadtest.fairness_bench import (
    MAX_DURATION_S,
    MOCK,
    REAL,
    _summary,
    calibrated_rate,
    fairness_figures,
    parse_args,
    phase_duration,
)
from loadtest.records import Outcome, RequestRecord


def test_the_mock_and_the_real_run_fill_in_their_own_defaults() -> None:
    mock, real = parse_args(["--mock"]), parse_args([])
    assert (mock.duration, mock.light_rate, mock.heavy_concurrency, mock.max_num_seqs) == (
        MOCK.duration_s,
        MOCK.light_rate,
        MOCK.heavy_concurrency,
        MOCK.max_num_seqs,
    )
    assert (real.duration, real.max_num_seqs, real.ordering) == (REAL.duration_s, REAL.max_num_seqs, "tiered")
    given = parse_args(["--mock", "--duration", "3", "--light-prompt-len", "8:16", "--ordering", "fcfs"])
    assert (given.duration, given.light_prompt_len, given.ordering) == (3.0, (8, 16), "fcfs")
    # A flood past saturation: more requests in flight than the worker runs at once.
    assert MOCK.heavy_concurrency > MOCK.max_num_seqs and REAL.heavy_concurrency > REAL.max_num_seqs


def test_the_real_light_load_is_calibrated_to_the_machine() -> None:
    real = parse_args([])
    assert real.light_rate is None and real.duration is None  # both set once a light request is timed
    assert (real.light_load, real.light_requests) == (0.2, 100)
    # A light request of 0.4 s alone: 0.5 req/s keeps the worker busy 20% of the time, 200 s for 100.
    assert calibrated_rate(real.light_load, 0.4) == 0.5
    assert phase_duration(real.light_requests, 0.5) == 200.0
    # A slow machine's phase is bounded; a given rate is taken as it is.
    assert phase_duration(30, 0.01) == MAX_DURATION_S
    assert parse_args(["--light-rate", "1"]).light_rate == 1.0


def records(ttft_s: float, n: int, *, failed: int = 0, tokens: int = 10) -> list[RequestRecord]:
    out = []
    for i in range(n + failed):
        sent = float(i)
        ok = i < n
        out.append(
            RequestRecord(
                i, "base", "standard", 16, tokens, t_sent=sent, t_end=sent + 1.0,
                chunk_times=[sent + ttft_s, sent + 1.0] if ok else [],
                outcome=Outcome.OK if ok else Outcome.TIMEOUT, num_output_tokens=tokens if ok else None,
            )
        )  # fmt: skip
    return out


def test_the_ratio_is_lights_ttft_p99_under_the_flood_over_alone() -> None:
    alone, flood = _summary(records(0.1, 5)), _summary(records(0.25, 4, failed=1))
    heavy = _summary(records(2.0, 20, tokens=50))  # 20 × 50 tokens over 20 s (sent 0..19, each 1 s)
    figures = fairness_figures(alone, flood, heavy)
    assert figures["light_ttft_p99_ms_alone"] == pytest.approx(100.0)
    assert figures["light_ttft_p99_ms_flood"] == pytest.approx(250.0)
    assert figures["fairness_ttft_ratio"] == 2.5
    assert (figures["light_completed_alone"], figures["light_completed_flood"], figures["light_failed"]) == (
        5,
        4,
        1,
    )
    assert (figures["heavy_completed"], figures["heavy_output_tok_s"]) == (20, 50.0)


def test_no_light_request_answered_means_no_ratio() -> None:
    figures = fairness_figures(_summary(records(0.1, 0, failed=2)), _summary(records(0.1, 3)), _summary([]))
    assert figures["fairness_ttft_ratio"] is None and figures["light_failed"] == 2
