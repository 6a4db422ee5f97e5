"""The gateway-overhead benchmark's plumbing, on mock workers and the mock engine, so it runs in seconds.

The figures are meaningless here; what is checked is that every field is there, the ratios are the
figures' ratios, every request completed on both sides, and no process of the server's group outlives it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {
    "model", "mock_workers", "threads", "single_max_tokens", "stack_single_tokens", "engine_single_tokens",
    "stack_tpot_ms", "engine_tpot_ms", "overhead_ratio", "num_streams", "max_tokens", "stack_completed",
    "engine_completed", "stack_tokens", "engine_tokens", "stack_tok_s", "engine_tok_s", "concurrent_ratio",
    "load_avg_1m", "server_pid",
}  # fmt: skip


def processes_in_group(pgid: int) -> list[int]:
    """Live pids whose process group is ``pgid`` (Linux /proc; field 5 of stat, after the comm)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return pids


def test_mock_run_prints_consistent_json() -> None:
    num_streams, max_tokens, single_tokens = 6, 12, 16
    command = [
        sys.executable, "-m", "loadtest.gateway_overhead", "--mock", "1", "--json",
        "--num-streams", str(num_streams), "--max-tokens", str(max_tokens),
        "--single-tokens", str(single_tokens),
    ]  # fmt: skip
    done = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=40,
    )
    assert done.returncode == 0, done.stderr
    assert "[gateway_overhead]" in done.stderr  # progress goes to stderr, stdout is the JSON alone
    result = json.loads(done.stdout)
    assert set(result) == FIELDS

    assert result["model"] == "mock"
    assert (result["num_streams"], result["max_tokens"]) == (num_streams, max_tokens)
    # The mock model never emits EOS: every request runs its full length on both sides.
    assert result["stack_completed"] == result["engine_completed"] == num_streams
    assert result["stack_tokens"] == result["engine_tokens"] == num_streams * max_tokens
    assert result["stack_single_tokens"] == result["engine_single_tokens"] == single_tokens

    for key in ("stack_tpot_ms", "engine_tpot_ms", "stack_tok_s", "engine_tok_s"):
        assert result[key] > 0, key
    assert result["overhead_ratio"] == pytest.approx(
        result["stack_tpot_ms"] / result["engine_tpot_ms"], rel=0.01
    )
    assert result["concurrent_ratio"] == pytest.approx(
        result["stack_tok_s"] / result["engine_tok_s"], rel=0.01
    )
    # A mock step sleeps 5 ms on both sides: the time per token cannot be much below that.
    assert result["engine_tpot_ms"] >= 4.5
    assert result["stack_tpot_ms"] >= 4.5

    # serve ran in its own session: its pid is the group id, and nothing of that group is left.
    assert processes_in_group(result["server_pid"]) == []
