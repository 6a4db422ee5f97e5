"""The ``peers`` scenario's arguments, its mixed phase's rate and vLLM's requirements. Fast: no install,
no server (the real run is ``tierserve bench peers``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.peers_bench import mixed_rate, parse_args
from loadtest.peers_figures import ServerResult
from loadtest.peers_install import VLLM_SKIPPED, runtime_requirements
from loadtest.peers_servers import (
    Precision,
    cores,
    llamacpp_launch,
    server_env,
    tierserve_launch,
    vllm_launch,
)
from tests.loadtest.peers_groups import group, measured
from wire.config import load_config


def test_defaults_follow_the_issue() -> None:
    args = parse_args([])
    assert (args.precision, args.output_tokens, args.num_single, args.concurrency) == ("best", 128, 4, 32)
    assert args.load_factor == 2.0 and args.servers == ["tierserve", "llamacpp", "vllm"]
    assert args.repeats == 3 and args.tierserve_policies == "tiered"
    assert parse_args(["--precision", "fp32"]).precision == Precision.FP32.value
    assert parse_args(["--servers", "vllm"]).servers == ["vllm"]
    assert parse_args([]).threads is None  # every core


@pytest.mark.parametrize(
    "argv",
    [
        ["--precision", "fp16"],
        ["--servers", "sglang"],
        ["--repeats", "0"],
        ["--repeats", "x"],
        ["--tierserve-policies", "lifo"],
    ],
)
def test_unknown_choices_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_threads_are_one_to_the_machines_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("loadtest.peers_bench.cores", lambda: 2)
    assert parse_args(["--threads", "1"]).threads == 1
    assert parse_args(["--threads", "2"]).threads == 2
    for bad in ("0", "3", "x"):
        with pytest.raises(SystemExit):
            parse_args(["--threads", bad])


def test_each_server_is_started_on_the_threads_it_is_given(tmp_path: Path) -> None:
    """--threads N: tierserve's worker through OMP_NUM_THREADS (serve then passes no --num-threads),
    vLLM bound to the first N cores, llama.cpp's -t; without it every core, whatever OMP_NUM_THREADS
    the bench's own environment has."""
    python, folder, gguf = tmp_path / "python", tmp_path / "model", tmp_path / "m.gguf"
    ours = tierserve_launch(Precision.FP32, tmp_path, "default", "tiered", 1)
    assert ours.env == {"OMP_NUM_THREADS": "1"}
    assert "OMP_NUM_THREADS" not in tierserve_launch(Precision.FP32, tmp_path, "default").env
    assert vllm_launch(python, folder, Precision.FP32, threads=1).env["VLLM_CPU_OMP_THREADS_BIND"] == "0-0"
    every = vllm_launch(python, folder, Precision.FP32).env["VLLM_CPU_OMP_THREADS_BIND"]
    assert every == f"0-{cores() - 1}"
    for threads, expected in ((1, "1"), (None, str(cores()))):
        command = llamacpp_launch(python, gguf, threads).command
        assert command[command.index("-t") + 1] == expected
    caller = {"OMP_NUM_THREADS": "7", "PYTHONPATH": "/ours", "PATH": "/bin"}
    assert server_env(ours, caller) == {"OMP_NUM_THREADS": "1", "PYTHONPATH": "/ours", "PATH": "/bin"}
    assert server_env(tierserve_launch(Precision.FP32, tmp_path, "default"), caller) == {
        "PYTHONPATH": "/ours",
        "PATH": "/bin",
    }
    peer = server_env(llamacpp_launch(python, gguf), caller)
    assert "OMP_NUM_THREADS" not in peer and "PYTHONPATH" not in peer and peer["PATH"] == "/bin"


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


def test_the_mixed_rate_follows_the_slowest_median_concurrent_run() -> None:
    vllm = measured("vllm", 4.0, 16.0)  # 32 requests in 16 s: 2 req/s
    vllm.concurrent = [group(8.0, 32, concurrent=True), vllm.concurrent[0], group(32.0, 32, concurrent=True)]
    ours = measured("tierserve", 2.0, 8.0)
    assert mixed_rate([ours, vllm], 2.0) == pytest.approx(4.0, rel=0.01)
    assert mixed_rate([ServerResult("vllm", error="start failed"), ours], 2.0) == pytest.approx(8.0, rel=0.01)
    assert mixed_rate([ServerResult("vllm", error="start failed")], 2.0) is None


def test_tierserve_serves_the_policy_set_it_is_told(tmp_path: Path) -> None:
    """The config tierserve starts with is a valid one, its worker policies the set named: the
    defaults (none named) unless told, fcfs's four with --tierserve-policies fcfs."""
    for policies, expected in (
        ("tiered", ("tiered", "slo-budget", "lowest-tier", "priority-weighted")),
        ("fcfs", ("fcfs", "static", "newest", "lru")),
    ):
        launch = tierserve_launch(Precision.FP32, tmp_path, "default", policies)
        config = load_config(launch.command[launch.command.index("--config") + 1], env={})
        assert config.models.pools[0].dtype == "float32" and config.models.pools[0].path == "default"
        chosen = config.policies
        assert (chosen.ordering.name, chosen.budget.name, chosen.preemption.name, chosen.eviction.name) == (
            expected
        )
