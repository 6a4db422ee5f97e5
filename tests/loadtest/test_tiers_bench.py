"""The ``tiers`` scenario: its batch accounting on hand-made records, and its plumbing end to end
against real ``serve --mock`` processes (figures meaningless there: a mock step costs no compute)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtest.launch import ROOT
from loadtest.records import Outcome, RequestRecord
from loadtest.tiers_bench import FAST_SHED_S, batch_completed_or_shed


def record(tier: str, outcome: Outcome, seconds: float) -> RequestRecord:
    return RequestRecord(0, "base", tier, 10, 10, t_sent=1.0, t_end=1.0 + seconds, outcome=outcome)


def test_batch_counts_completions_and_fast_sheds_only() -> None:
    records = [
        record("batch", Outcome.OK, 50.0),
        record("batch", Outcome.RATE_LIMITED, 0.01),  # a fast 429
        record("batch", Outcome.RATE_LIMITED, FAST_SHED_S + 1),  # a 429 after waiting: not fast
        record("batch", Outcome.TIMEOUT, 900.0),
        record("interactive", Outcome.TIMEOUT, 900.0),  # not batch: not counted
    ]
    assert batch_completed_or_shed(records) == pytest.approx(2 / 4)
    assert batch_completed_or_shed([record("interactive", Outcome.OK, 1.0)]) is None


@pytest.mark.timeout(300)
def test_the_scenario_runs_end_to_end_on_mock_workers() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tierserve", "bench", "tiers", "--json", "--mock",
         "--duration", "3", "--probe-s", "2", "--probe-rates", "4", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in (
        "interactive_attainment_fcfs",
        "interactive_attainment_tiered",
        "interactive_attainment_tiered_4x",
        "batch_shed_fraction",
        "batch_shed_fraction_4x",
        "throughput_tok_s_fcfs",
        "throughput_tok_s_tiered",
        "throughput_ratio",
        "batch_completed_or_shed_fraction",
    ):
        assert figures[key] is not None, key
    assert [p["rate"] for p in figures["probes"]] == [4.0, 8.0][: len(figures["probes"])]
    assert figures["rate"] == figures["saturation_rate"] * 2
    assert figures["num_requests"] > 0 and figures["throughput_tok_s_tiered"] > 0
    assert figures["rate_4x"] == figures["rate"] * 2
    assert set(figures["per_tier"]) == {"fcfs", "tiered", "tiered_4x"}
    assert "ttft_p99_ms" in figures["per_tier"]["tiered"]["interactive"]
