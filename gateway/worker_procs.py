"""How ``tierserve serve`` starts and stops its worker processes: each pool's command line (engine
settings, policies, context classes, threads, CURVE keys), the environment they inherit (plus each
one's own, e.g. its GPU), their log files, and their end.

Workers are started by command line only (``python -m worker.cli worker ...``): the gateway never
imports the worker package, so it stays torch-free. On Linux a worker gets SIGTERM when serve dies,
even by SIGKILL (``PR_SET_PDEATHSIG``), so no worker outlives its gateway.

Workers run ``WORKER_NICENESS`` below the gateway: on a CPU box their compute threads fill every
core, and the gateway's event loop (streaming every token out) then waited for a scheduler slice
while the step's other threads waited for the one it displaced. Measured on a 2-core EPYC, float32,
one stream, alternated three times: 59 tok/s mean at the same priority, 69 with the workers at +5.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from gateway.tokenizer import PromptBuilder
from policies.base import PolicyKind
from wire import config as config_kinds
from wire.config import ModelPool, ServerConfig

WORKER_STOP_TIMEOUT_S = 10.0
PR_SET_PDEATHSIG = 1
WORKER_NICENESS = 5
WORKER_POLICY_KINDS = cast(tuple[PolicyKind, ...], config_kinds.WORKER_POLICY_KINDS)


@dataclass(slots=True)
class PoolLaunch:
    """One model pool as serve starts it."""

    name: str  # what its workers register as and clients put in "model"
    pool: ModelPool  # role and engine settings (dtype, KV cache, sequences, batched tokens)
    builder: PromptBuilder
    worker_args: Sequence[str]  # passed to each of its `worker` subcommands (--mock, or --model FOLDER)
    num_workers: int
    worker_prefix: str | None = None  # its workers are "<prefix>-<i>" (default: ``name``)
    # Worker i's own environment on top of serve's: its GPU (``CUDA_VISIBLE_DEVICES``), chosen by the
    # composition root (tierserve/worker_plan.py), which may ask torch; empty: none for any worker.
    worker_envs: Sequence[Mapping[str, str]] = ()

    @property
    def ranks_per_worker(self) -> int:
        """Processes each of its workers runs: its tensor-parallel ranks."""
        return self.pool.tensor_parallel_size

    def env_of(self, index: int) -> Mapping[str, str]:
        return self.worker_envs[index] if index < len(self.worker_envs) else {}


def policies_arg(config: ServerConfig) -> list[str]:
    """The worker kinds of the config's [policies], as the worker's --policies JSON."""
    return ["--policies", json.dumps(config.policies.worker_selections())]


def pool_args(pool: ModelPool) -> list[str]:
    """A pool's engine settings as worker flags (``worker_args`` given after them win, argparse keeping
    the last)."""
    classes = ["--context-classes", ",".join(pool.context_classes)] if pool.context_classes else []
    limit = ["--max-model-len", str(pool.max_context)] if pool.max_context is not None else []
    kept = ["--keep-full-precision", ",".join(pool.keep_full_precision)] if pool.keep_full_precision else []
    kv = ["--kv-cache-gb", str(pool.kv_cache_gb)] if pool.kv_cache_gb is not None else []
    graphs = [] if pool.cuda_graphs else ["--no-cuda-graphs"]
    tp = ["--tensor-parallel-size", str(pool.tensor_parallel_size)] if pool.tensor_parallel_size > 1 else []
    return [
        "--dtype", pool.dtype,
        "--device", pool.device,
        *kv,
        "--gpu-memory-utilization", str(pool.gpu_memory_utilization),
        *graphs,
        *tp,
        "--max-num-seqs", str(pool.max_num_seqs),
        "--max-num-batched-tokens", str(pool.max_num_batched_tokens),
        "--quant-activations", pool.quant_activations,
        "--quantization", pool.quantization,
        "--kv-cache-dtype", pool.kv_cache_dtype,
        *classes,
        *limit,
        *kept,
    ]  # fmt: skip


def threads_arg(pools: Sequence[PoolLaunch]) -> list[str]:
    """``--num-threads``: this host's cores shared among the processes serve's workers run (a
    tensor-parallel worker runs one per rank, each taking this many), so two workers on two cores do
    not each run two threads and stall each other; none when OMP_NUM_THREADS decides."""
    if "OMP_NUM_THREADS" in os.environ:
        return []
    num_ranks = sum(launch.num_workers * launch.ranks_per_worker for launch in pools)
    return ["--num-threads", str(max(1, (os.cpu_count() or 1) // max(num_ranks, 1)))]


@dataclass(slots=True)
class WorkerProcess:
    """One worker serve started: its process, its id, and the log file it writes (``--log-file``)."""

    worker_id: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def start_failure(self) -> str:
        """Why it exited, in one line: its log's last line (``cannot start: ...`` when the engine failed
        to start), with the log's path for the rest."""
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            lines = []
        cause = lines[-1].strip() if lines else "it logged nothing"
        code = self.process.returncode
        return f"worker {self.worker_id!r} exited with code {code}: {cause} (log: {self.log_path})"


@dataclass(slots=True, frozen=True)
class WorkerCommand:
    """What starting one worker runs: its id, command line, whole environment and log file."""

    worker_id: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path


def worker_command(
    address: str,
    index: int,
    launch: PoolLaunch,
    config: ServerConfig,
    log_dir: Path,
    curve_args: Sequence[str] = (),
) -> WorkerCommand:
    worker_id = f"{launch.worker_prefix or launch.name}-{index}"
    log_path = log_dir / f"{worker_id}.log"
    argv = [
        sys.executable, "-m", "worker.cli", "worker", "--connect", address,
        "--worker-id", worker_id, "--served-name", launch.name, "--log-file", str(log_path),
        *pool_args(launch.pool),
        *policies_arg(config), *curve_args, *launch.worker_args,
    ]  # fmt: skip
    return WorkerCommand(worker_id, argv, {**worker_env(config), **launch.env_of(index)}, log_path)


def spawn(
    address: str,
    index: int,
    launch: PoolLaunch,
    config: ServerConfig,
    log_dir: Path,
    curve_args: Sequence[str] = (),
) -> WorkerProcess:
    command = worker_command(address, index, launch, config, log_dir, curve_args)
    process = subprocess.Popen(command.argv, env=command.env, preexec_fn=in_worker_before_exec)
    return WorkerProcess(command.worker_id, process, command.log_path)


def worker_env(config: ServerConfig) -> dict[str, str]:
    """The workers' environment: ours (so the same OTEL_* variables configure their tracing), with the
    config's service name unless OTEL_SERVICE_NAME names one."""
    env = dict(os.environ)
    env.setdefault("OTEL_SERVICE_NAME", config.telemetry.service_name)
    return env


def in_worker_before_exec() -> None:
    """In the child before exec: WORKER_NICENESS below us, and (Linux) SIGTERM when this process dies,
    even by SIGKILL (no orphans)."""
    os.nice(WORKER_NICENESS)
    if sys.platform == "linux":
        die_with_parent()


def die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_workers(workers: Sequence[WorkerProcess]) -> None:
    for worker in (w.process for w in workers):
        if worker.poll() is None:
            worker.terminate()
    deadline = time.monotonic() + WORKER_STOP_TIMEOUT_S
    for worker in (w.process for w in workers):
        try:
            worker.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
