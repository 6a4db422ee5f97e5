"""How serve starts a worker process: its flags and environment, below the gateway's priority, tied to
the gateway's life."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.tokenizer import BytePromptBuilder
from gateway.worker_procs import (
    WORKER_NICENESS,
    PoolLaunch,
    in_worker_before_exec,
    pool_args,
    worker_command,
    worker_env,
)
from wire.config import ModelPool, ServerConfig


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no os.nice on this platform")
def test_a_worker_runs_below_the_gateway() -> None:
    ours = os.nice(0)
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.nice(0))"],
        preexec_fn=in_worker_before_exec,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert int(child.stdout) == min(ours + WORKER_NICENESS, 19)


def _flags(args: list[str]) -> dict[str, str | None]:
    """``--flag value`` and bare ``--flag`` pairs of a command line."""
    flags: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            following = args[i + 1] if i + 1 < len(args) else None
            flags[arg] = None if following is None or following.startswith("--") else following
    return flags


def test_pool_args_pass_the_device_and_its_memory_settings() -> None:
    flags = _flags(pool_args(ModelPool(name="m")))
    assert flags["--device"] == "auto"
    assert "--kv-cache-gb" not in flags  # unset: the worker sizes its KV cache from its device
    assert flags["--gpu-memory-utilization"] == "0.9"
    assert "--no-cuda-graphs" not in flags
    pool = ModelPool(name="m", device="cuda", kv_cache_gb=8.0, gpu_memory_utilization=0.5, cuda_graphs=False)
    flags = _flags(pool_args(pool))
    assert (flags["--device"], flags["--kv-cache-gb"], flags["--gpu-memory-utilization"]) == (
        "cuda",
        "8.0",
        "0.5",
    )
    assert "--no-cuda-graphs" in flags
    assert _flags(pool_args(ModelPool(name="m", device="cpu")))["--device"] == "cpu"


def test_the_worker_cli_takes_every_flag_pool_args_gives() -> None:
    from worker.cli_parser import build_parser

    pool = ModelPool(name="m", device="cuda", kv_cache_gb=2.0, cuda_graphs=False, context_classes=("short",))
    args = build_parser().parse_args(["worker", "--connect", "tcp://127.0.0.1:1", *pool_args(pool)])
    assert (args.device, args.kv_cache_gb, args.no_cuda_graphs) == ("cuda", 2.0, True)
    assert build_parser().parse_args(["worker", "--connect", "x"]).device == "auto"


def test_each_worker_gets_its_own_environment_on_top_of_serves(tmp_path: Path) -> None:
    pool = ModelPool(name="m")
    envs = ({"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "5"})
    launch = PoolLaunch("m", pool, BytePromptBuilder(), ["--mock"], 2, worker_envs=envs)
    config = ServerConfig()
    commands = [worker_command("tcp://127.0.0.1:1", i, launch, config, tmp_path) for i in range(2)]
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in commands] == ["2", "5"]
    assert all(c.env["OTEL_SERVICE_NAME"] for c in commands)  # serve's own environment is kept
    assert [c.worker_id for c in commands] == ["m-0", "m-1"]
    assert commands[1].argv[commands[1].argv.index("--worker-id") + 1] == "m-1"
    plain = PoolLaunch("m", pool, BytePromptBuilder(), ["--mock"], 1)
    assert worker_command("tcp://127.0.0.1:1", 0, plain, config, tmp_path).env == worker_env(config)
