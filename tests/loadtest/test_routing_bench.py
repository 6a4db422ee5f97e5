"""The ``routing`` scenario end to end at a tiny size against real ``serve --mock`` processes: the JSON's
shape and its internal consistency (the wall-clock figures themselves are not judged here).

The configuration makes one comparison deterministic: requests one at a time (a closed loop of 1), a
KV cache that holds every system prompt, so no block is ever evicted. Round-robin then misses once per
(worker, system prompt) pair it meets; prefix-load keeps each system prompt on the worker that has it
and misses once per system prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.launch import ROOT

NUM_REQUESTS, NUM_WORKERS, NUM_PREFIXES = 24, 2, 3
SIDES = ("prefix", "rr")


DOCS = "# Benchmarks\n\n## routing — prefix-load vs round-robin\n\nProse.\n\n## next\n\nMore prose.\n"


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("routing") / "benchmarks.md"
    path.write_text(DOCS)
    return path


@pytest.fixture(scope="module")
def figures(docs: Path) -> dict[str, object]:
    command = [
        sys.executable, "-m", "tierserve", "bench", "routing", "--json", "--record", "--docs", str(docs),
        "--workers", str(NUM_WORKERS), "--num-requests", str(NUM_REQUESTS), "--concurrency", "1",
        "--num-prefixes", str(NUM_PREFIXES), "--prefix-len", "256", "--user-len", "8:24",
        "--output-len", "4:8", "--mock-step-ms", "2", "--mock-token-ms", "0.01", "--mock-kv-blocks", "256",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr
    assert "[routing] prefix (prefix-load)" in proc.stderr  # progress on stderr; stdout is the JSON
    result = json.loads(proc.stdout)
    assert isinstance(result, dict)
    return result


def num(figures: dict[str, object], key: str) -> float:
    value = figures[key]
    assert isinstance(value, int | float), (key, value)
    return value


def counts(figures: dict[str, object], key: str) -> dict[str, int]:
    value = figures[key]
    assert isinstance(value, dict), (key, value)
    return value


@pytest.mark.timeout(180)
def test_every_figure_is_there_for_both_sides(figures: dict[str, object]) -> None:
    assert figures["scenario"] == "routing" and figures["model"] == "mock"
    for name in ("ttft_p50", "ttft_p90", "hit_rate", "request_hit_rate", "output_tok_s", "prompt_tokens"):
        for side in SIDES:
            assert num(figures, f"{name}_{side}") >= 0, name
    for ratio in ("ttft_ratio", "throughput_ratio"):
        assert num(figures, ratio) > 0
    for side in SIDES:
        assert figures[f"completed_{side}"] == NUM_REQUESTS


@pytest.mark.timeout(180)
def test_the_figures_agree_with_each_other(figures: dict[str, object]) -> None:
    # The same requests on both sides (the mock never ends early: every answer is max_tokens long).
    assert figures["prompt_tokens_prefix"] == figures["prompt_tokens_rr"]
    assert figures["output_tokens_prefix"] == figures["output_tokens_rr"]
    assert num(figures, "ttft_ratio") == pytest.approx(
        num(figures, "ttft_p50_prefix") / num(figures, "ttft_p50_rr"), abs=2e-3
    )
    assert num(figures, "throughput_ratio") == pytest.approx(
        num(figures, "output_tok_s_prefix") / num(figures, "output_tok_s_rr"), abs=2e-3
    )
    for side in SIDES:
        cached, prompt = num(figures, f"cached_tokens_{side}"), num(figures, f"prompt_tokens_{side}")
        assert 0 <= cached < prompt
        assert num(figures, f"hit_rate_{side}") == pytest.approx(cached / prompt, abs=1e-3)
        assert 0 <= num(figures, f"request_hit_rate_{side}") <= 1
        assert num(figures, f"ttft_p50_{side}") <= num(figures, f"ttft_p90_{side}")
        # Every request's placement was seen (x-tierserve-worker), on the fleet's workers.
        per_worker = counts(figures, f"requests_per_worker_{side}")
        assert sum(per_worker.values()) == NUM_REQUESTS
        assert set(per_worker) <= {f"mock-{i}" for i in range(NUM_WORKERS)}
        assert len(counts(figures, f"workers_per_system_prompt_{side}")) == NUM_PREFIXES


@pytest.mark.timeout(180)
def test_prefix_routing_keeps_each_system_prompt_on_one_worker(figures: dict[str, object]) -> None:
    assert set(counts(figures, "workers_per_system_prompt_prefix").values()) == {1}
    assert max(counts(figures, "workers_per_system_prompt_rr").values()) == NUM_WORKERS
    assert num(figures, "hit_rate_prefix") > num(figures, "hit_rate_rr")
    assert num(figures, "request_hit_rate_prefix") > num(figures, "request_hit_rate_rr")
    # One cold miss per system prompt, every other request a hit.
    assert num(figures, "request_hit_rate_prefix") == pytest.approx(1 - NUM_PREFIXES / NUM_REQUESTS, abs=1e-3)
    assert figures["evictions_prefix"] == figures["evictions_rr"] == 0


@pytest.mark.timeout(180)
def test_record_writes_the_figures_into_the_routing_section(figures: dict[str, object], docs: Path) -> None:
    text = docs.read_text()
    begin, end = text.index("<!-- bench:routing:begin -->"), text.index("<!-- bench:routing:end -->")
    assert text.index("## routing") < text.index("Prose.") < begin < end < text.index("## next")
    block = text[begin:end]
    recorded = json.loads(block[block.index("```json") + len("```json") : block.rindex("```")])
    assert recorded == figures
