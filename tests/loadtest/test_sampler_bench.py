"""bench sampler end to end on the embedded model (a small batch): its JSON, and that the C kernels and
the torch references drew the same tokens."""

from __future__ import annotations

import pytest

from loadtest.sampler_bench import CONFIGS, parse_args, run

pytestmark = pytest.mark.timeout(300)


def test_a_small_run_times_both_and_finds_the_same_tokens() -> None:
    figures = run(parse_args(["--rows", "3", "--tokens", "3", "--repeats", "2"]))
    assert figures["scenario"] == "sampler" and figures["rows"] == 3
    assert figures["same_tokens"] is True
    configs = figures["configs"]
    assert isinstance(configs, dict) and set(configs) == set(CONFIGS)
    for row in configs.values():
        assert row["reference_ms"] > 0 and row["kernels_ms"] > 0 and row["ratio"] > 0


def test_arguments_are_checked() -> None:
    assert parse_args([]).rows == 32
    for bad in (["--rows", "0"], ["--tokens", "1"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
