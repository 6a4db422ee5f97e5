"""``tierserve load`` and ``tierserve bench load-smoke`` as real processes against a real
``tierserve serve --mock 2`` on 127.0.0.1, bounded in requests and time.

What the server said is checked against what the workload built: the mock model never stops early, so
each request's completion_tokens is its max_tokens, and its prompt_tokens (the server's own tokenization)
is the length the load generator built.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.launch import Server, free_port, running_server
from loadtest.prompt_text import load_tokenizer
from loadtest.workloads import Api, Workload, WorkloadOptions

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(["--mock", "2"], log_path, ready_timeout_s=60) as running:
        yield running


def tierserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierserve", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_load_writes_json_markdown_plots_consistent_with_the_server(server: Server, tmp_path: Path) -> None:
    num = 30
    out = tmp_path / "out"
    done = tierserve(
        "load", "--base-url", server.base_url, "--workload", "mixed-tiers", "--rate", "40",
        "--num-requests", str(num), "--prompt-len", "16:200", "--output-len", "4:16", "--seed", "5",
        "--output-dir", str(out), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "[load]" in done.stderr and f"sent {num}/{num}" in done.stderr  # the progress line
    result = json.loads(done.stdout)
    assert json.loads((out / "result.json").read_text()) == result

    [target] = result["targets"]
    overall = target["summary"]["overall"]
    tiers = target["summary"]["tiers"]
    assert target["model"] == "mock"
    assert overall["num_requests"] == overall["num_ok"] == overall["outcomes"]["ok"] == num
    assert sum(t["num_requests"] for t in tiers.values()) == num
    assert set(tiers) <= {"interactive", "standard", "batch"} and len(tiers) >= 2

    # The same seeded workload rebuilt here: the server's usage must agree with it request by request.
    workload = Workload(
        "mixed-tiers", load_tokenizer("bytes", "mock"), Api.CHAT, 5, WorkloadOptions((16, 200), (4, 16))
    )
    rows = read_jsonl(out / "requests.jsonl")
    assert sorted(r["index"] for r in rows) == list(range(num))
    for row in rows:
        spec = workload.request(row["index"])
        assert row["outcome"] == "ok" and row["status"] == 200
        assert row["num_prompt_tokens"] == row["expected_prompt_tokens"] == spec.num_prompt_tokens
        assert row["num_output_tokens"] == row["max_tokens"] == spec.max_tokens
        assert row["tier"] == spec.tier  # asked for in X-SLA-Tier, echoed by the server
    assert overall["num_output_tokens"] == sum(workload.request(i).max_tokens for i in range(num))
    assert overall["num_prompt_tokens"] == sum(workload.request(i).num_prompt_tokens for i in range(num))
    assert overall["ttft_ms"]["count"] == num and overall["ttft_ms"]["p50"] > 0
    assert sum(target["timeline"]["output_tok_s"]) * target["timeline"]["bin_s"] == pytest.approx(
        overall["num_output_tokens"]
    )

    summary = (out / "summary.md").read_text()
    for tier in tiers:
        assert f"| {tier} | {tiers[tier]['num_requests']} |" in summary
    assert f"| **all** | {num} | 0 |" in summary
    for name in ("latency_cdf.png", "timeline.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000, name


def test_compare_interleaves_one_workload_on_two_servers(server: Server, tmp_path: Path) -> None:
    # The same server twice: both sides must see identical requests, and a header reaches both.
    done = tierserve(
        "load", "--base-url", server.base_url, "--compare", f"{server.base_url}/v1", "--workload", "chat",
        "--concurrency", "4", "--num-requests", "12", "--prompt-len", "20:60", "--output-len", "4:8",
        "-H", "X-SLA-Tier: batch", "--output-dir", str(tmp_path), "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "## ratios" in done.stdout and "| output_tok_s |" in done.stdout  # the table printed
    result = json.loads((tmp_path / "result.json").read_text())
    assert [t["label"] for t in result["targets"]] == ["base", "compare"]
    assert set(result["ratios"]) >= {"output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "goodput_req_s"}
    assert result["ratios"]["output_tok_s"] > 0
    rows = read_jsonl(tmp_path / "requests.jsonl")
    sides = {
        label: {
            (r["index"], r["expected_prompt_tokens"], r["max_tokens"]) for r in rows if r["target"] == label
        }
        for label in ("base", "compare")
    }
    assert len(sides["base"]) == 12 and sides["base"] == sides["compare"]
    assert {r["tier"] for r in rows} == {"batch"}
    assert all(r["outcome"] == "ok" for r in rows)


def test_an_unreachable_server_is_counted_not_crashed(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    done = tierserve(
        "load", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", "bytes",
        "--rate", "50", "--num-requests", "5", "--output-len", "4", "--json", "--quiet", "--no-output",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    overall = json.loads(done.stdout)["targets"][0]["summary"]["overall"]
    assert overall["outcomes"]["transport_error"] == 5 and overall["num_ok"] == 0
    assert overall["slo_attainment"] == 0.0 and overall["goodput_req_s"] == 0.0


def test_bench_load_smoke_records_its_section(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## engine — ours\n\nprose\n")
    done = tierserve("bench", "load-smoke", "--json", "--record", "--docs", str(docs), "--num-requests", "16")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["completed"] == figures["num_requests"] == figures["prompt_tokens_as_built"] == 16
    assert figures["failed"] == 0
    assert figures["tpot_p50_ms"] >= figures["mock_step_ms"] * 0.9  # a mock step sleeps 5 ms
    assert figures["tpot_over_step_ratio"] == pytest.approx(
        figures["tpot_p50_ms"] / figures["mock_step_ms"], rel=0.01
    )
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\n## engine — ours\n\nprose\n")
    recorded = text.split("<!-- bench:load-smoke:begin -->")[1].split("<!-- bench:load-smoke:end -->")[0]
    assert json.loads(recorded.split("```json\n")[1].split("```")[0]) == figures
