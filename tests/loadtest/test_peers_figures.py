"""The ``peers`` figures: a server's median repetition, ratios ours ÷ theirs, nulls for a peer that
failed, the block a run records into. Fast: summaries built from records, no server."""

from __future__ import annotations

import pytest

from loadtest.metrics import summarize
from loadtest.peers_bench import mixed_rate, parse_args
from loadtest.peers_figures import ServerResult, figures, median_run, ratio, scenario_name, server_figures
from loadtest.peers_servers import Precision
from loadtest.records import Outcome, RequestRecord
from tests.loadtest.peers_groups import TOKENS, group, measured
from worker.cpu_isa import caps_from_flags

AVX2_FLAGS = frozenset({"sse4_1", "avx", "avx2", "fma", "f16c"})
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"}
ZEN4 = caps_from_flags(AVX512_FLAGS, "AMD EPYC 9R14")  # the figures' machine, whatever runs the tests


def test_ratio_is_ours_over_theirs_and_null_when_a_side_is_missing() -> None:
    assert ratio(60.0, 40.0) == 1.5
    assert ratio(1.0, 3.0) == 0.333
    assert ratio(None, 40.0) is None
    assert ratio(60.0, None) is None
    assert ratio(60.0, 0.0) is None


def test_figures_per_server_and_ratios() -> None:
    ours, vllm, llamacpp = (
        measured("tierserve", 2.0, 8.0),
        measured("vllm", 4.0, 16.0),
        measured("llamacpp", 1.0, 4.0),
    )
    results = {r.name: r for r in (ours, vllm, llamacpp)}
    out = figures(parse_args([]), results, mixed_rate(results.values(), 2.0), ZEN4)
    single = {name: out[name]["single_tok_s"] for name in results}  # type: ignore[index]
    assert single["tierserve"] == pytest.approx(TOKENS / 2.0, rel=0.01)
    assert out["single_ratio_vs_vllm"] == pytest.approx(2.0, abs=0.01)
    assert out["single_ratio_vs_llamacpp"] == pytest.approx(0.5, abs=0.01)
    assert out["concurrent_ratio_vs_vllm"] == pytest.approx(2.0, abs=0.01)
    assert out["concurrent_ratio_vs_llamacpp"] == pytest.approx(0.5, abs=0.01)
    tpot = out["tierserve"]["single_tpot_ms"]  # type: ignore[index]
    assert tpot == pytest.approx(1.9 / (TOKENS - 1) * 1e3, rel=0.01)
    # the slowest concurrent capacity is vLLM's 32 requests in 16 s: 2 req/s, twice that is 4
    assert out["mixed_rate_req_s"] == pytest.approx(4.0, rel=0.01)
    assert out["scenario"] == "peers" and "cpu" in out


def test_a_failed_peer_has_null_figures_and_ratios_and_the_rest_stand() -> None:
    ours, llamacpp = measured("tierserve", 2.0, 8.0), measured("llamacpp", 1.0, 4.0)
    vllm = ServerResult("vllm", error="install failed: pip exit status 1")
    results = {"tierserve": ours, "vllm": vllm, "llamacpp": llamacpp}
    out = figures(parse_args(["--precision", "fp32"]), results, mixed_rate(results.values(), 2.0), ZEN4)
    assert out["vllm"]["error"].startswith("install failed")  # type: ignore[index]
    assert out["vllm"]["single_tok_s"] is None  # type: ignore[index]
    assert out["single_ratio_vs_vllm"] is None and out["concurrent_ratio_vs_vllm"] is None
    assert out["single_ratio_vs_llamacpp"] == pytest.approx(0.5, abs=0.01)
    assert out["scenario"] == "peers-fp32"
    assert mixed_rate([vllm], 2.0) is None


def test_a_gguf_run_records_into_its_own_block() -> None:
    args = parse_args(["--tierserve-path", "/models/x.Q4_1.gguf"])
    assert figures(args, {}, None, ZEN4)["scenario"] == "peers-gguf"
    assert figures(args, {}, None, ZEN4)["tierserve_path"] == "/models/x.Q4_1.gguf"
    assert scenario_name(Precision.FP32, "default-q4_1", ZEN4) == "peers-fp32"  # the default pool path
    assert scenario_name(Precision.BEST, "default", ZEN4) == "peers-float"
    assert scenario_name(Precision.BEST, "/models/llama", ZEN4) == "peers-folder"


def test_a_run_below_avx512_records_beside_the_avx512_one_and_a_capped_run_says_so() -> None:
    avx2 = caps_from_flags(AVX2_FLAGS, "AMD EPYC 7B13")
    assert scenario_name(Precision.FP32, "default", avx2) == "peers-fp32-float-avx2"
    assert scenario_name(Precision.BEST, "default-q4_1", caps_from_flags({"sse4_1"})) == "peers-generic"
    # TIERSERVE_CPU_ISA lowers our kernels only: not the same comparison as an AVX2 CPU's.
    capped = caps_from_flags(ZEN4.flags, "AMD EPYC 9R14", override="avx2")
    assert scenario_name(Precision.FP32, "default", capped) == "peers-fp32-float-avx2-capped"
    capped_high = caps_from_flags(ZEN4.flags, "AMD EPYC 9R14", override="avx512")
    assert scenario_name(Precision.FP32, "default", capped_high) == "peers-fp32-float-capped"


def test_a_run_on_the_fcfs_set_records_beside_the_defaults_one() -> None:
    avx2 = caps_from_flags(AVX2_FLAGS, "AMD EPYC 7B13")
    assert scenario_name(Precision.FP32, "default", avx2, "fcfs") == "peers-fp32-float-avx2-fcfs"
    assert scenario_name(Precision.FP32, "default", avx2, "tiered") == "peers-fp32-float-avx2"
    args = parse_args(["--precision", "fp32", "--tierserve-path", "default", "--tierserve-policies", "fcfs"])
    out = figures(args, {}, None, ZEN4)
    assert (out["scenario"], out["tierserve_policies"]) == ("peers-fp32-float-fcfs", "fcfs")


def test_a_run_on_fewer_threads_than_cores_records_beside_the_whole_machines_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("loadtest.peers_bench.cores", lambda: 4)
    monkeypatch.setattr("loadtest.peers_figures.cores", lambda: 4)
    capped = caps_from_flags(ZEN4.flags, "AMD EPYC 9R14", override="avx2")
    name = scenario_name(Precision.FP32, "default", capped, "fcfs", 1)
    assert name == "peers-fp32-float-avx2-capped-threads-1-fcfs"
    argv = ["--precision", "fp32", "--tierserve-path", "default", "--threads", "1"]
    one = figures(parse_args(argv), {}, None, ZEN4)
    assert (one["scenario"], one["threads"]) == ("peers-fp32-float-threads-1", 1)
    for argv in ([], ["--threads", "4"]):  # every core, asked for or not: the whole machine's block
        whole = figures(parse_args(["--precision", "fp32", *argv]), {}, None, ZEN4)
        assert (whole["scenario"], whole["threads"]) == ("peers-fp32", 4)


def test_a_phase_with_a_failed_request_is_no_comparison() -> None:
    result = measured("vllm", 4.0, 16.0)
    records = [RequestRecord(0, "x", "standard", 40, TOKENS, 0.0, 1.0, outcome=Outcome.TIMEOUT)]
    result.single = [summarize(records, {}, 1.0).overall]
    out = server_figures(result)
    assert out["single_tok_s"] is None and out["single_ok"] == "0/1"
    assert out["single_tok_s_runs"] == [None] and out["single_output_tokens"] is None
    assert out["concurrent_tok_s"] is not None


def test_the_median_repetition_counts_and_every_run_is_listed() -> None:
    slow, middle, fast = group(4.0, 4), group(2.0, 4), group(1.0, 4)
    assert median_run([slow, fast, middle]) is middle
    assert median_run([fast, slow]) is slow  # an even count: the lower middle
    assert median_run([]) is None
    result = ServerResult("tierserve", "float32", None, 5.0, [fast, slow, middle], [])
    out = server_figures(result)
    assert out["single_tok_s"] == pytest.approx(TOKENS / 2.0, rel=0.01)
    assert out["single_tpot_ms"] == pytest.approx(1.9 / (TOKENS - 1) * 1e3, rel=0.01)  # middle's own
    runs = out["single_tok_s_runs"]
    assert isinstance(runs, list) and [round(r) for r in runs] == [128, 32, 64]  # in the order they ran
    assert out["single_ok"] == "12/12" and out["single_output_tokens"] == 4 * TOKENS
    assert "concurrent_ok" not in out and out["concurrent_tok_s"] is None


def test_a_repetition_with_a_failed_request_is_left_out_of_the_median() -> None:
    failed = [RequestRecord(0, "x", "standard", 40, TOKENS, 0.0, 1.0, outcome=Outcome.TRANSPORT_ERROR)]
    failed_run = summarize(failed, {}, 1.0).overall
    slow, fast = group(4.0, 4), group(1.0, 4)
    result = ServerResult("llamacpp", "q4_1", None, 0.5, [fast, failed_run, slow], [])
    out = server_figures(result)
    assert out["single_tok_s"] == pytest.approx(TOKENS / 4.0, rel=0.01)  # of the two usable: the lower
    assert out["single_tok_s_runs"][1] is None  # type: ignore[index]
    assert out["single_ok"] == "8/9"


def test_retried_requests_are_counted_where_there_were_any() -> None:
    record = RequestRecord(0, "x", "standard", 40, TOKENS, 0.0, 1.0)
    record.chunk_times, record.num_output_tokens, record.num_retries = [0.5, 1.0], 2, 1
    retried = summarize([record], {}, 1.0).overall
    assert retried.num_retried == 1
    result = ServerResult("llamacpp", "q4_1", None, 0.5, [retried, group(1.0, 4)], [group(1.0, 4)])
    out = server_figures(result)
    assert out["single_retried"] == 1 and "concurrent_retried" not in out


def test_the_hypervisors_share_of_each_repetition_is_listed_where_it_was_read() -> None:
    result = ServerResult("vllm", "float32")
    for single, concurrent, steal in ((1.0, 4.0, 0.0), (2.0, 8.0, 12.5)):
        result.add("single", group(single, 4), steal)
        result.add("concurrent", group(concurrent, 32, concurrent=True), None)
    out = server_figures(result)
    assert out["single_steal_pct_runs"] == [0.0, 12.5]
    assert "concurrent_steal_pct_runs" not in out  # never read (no /proc/stat): no figure, not zeros
    assert "read_gb_s_around" not in out  # not probed (a check, or the mixed run's second start)
    result.read_gb_s_around = (33.1, 21.4)
    assert server_figures(result)["read_gb_s_around"] == [33.1, 21.4]
    assert out["single_tok_s_runs"] == [
        pytest.approx(TOKENS / 1.0, rel=0.01),
        pytest.approx(TOKENS / 2.0, rel=0.01),
    ]
