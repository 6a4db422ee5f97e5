"""The ``peers`` bench's three servers: how each is started, alone, on 127.0.0.1 on a free port.

    with running(tierserve_launch(Precision.BEST, workdir), workdir / "tierserve.log") as server:
        ...  # server.base_url; server.session: its session's id (the process it started)

Each runs in its own session (process group); ``running`` waits for its health endpoint, and on the
way out, whatever happened, terminates then kills the whole group (``launch.stop_server``). A peer
gets none of our PYTHONPATH or VIRTUAL_ENV, only what its ``Launch.env`` names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import httpx

from loadtest.launch import HOST, ROOT, free_port, log_tail, stop_server
from loadtest.policy_sets import DEFAULT_SET, POLICY_SETS
from loadtest.record import cpu_caps
from wire.config import DEFAULT_MODEL_PATH

MODEL = "smollm2-135m-instruct"  # the name every server is asked for
KV_CACHE_GB = 4  # vLLM's VLLM_CPU_KVCACHE_SPACE, and tierserve's pool the same
VLLM_MAX_MODEL_LEN = 4096
VLLM_READY_S = 360.0
TIERSERVE_READY_S = 600.0
LLAMACPP_READY_S = 120.0
LLAMACPP_CONTEXT, LLAMACPP_SLOTS = 16384, 32
POLL_INTERVAL_S = 0.5


class Precision(Enum):
    BEST = "best"  # each server's fastest configuration on this CPU
    FP32 = "fp32"  # tierserve and vLLM in float32 (llama.cpp stays on the GGUF's Q4_1)


class ServerExited(RuntimeError):
    """The server's process ended before it was ready (``returncode`` < 0: killed by that signal)."""

    def __init__(self, name: str, returncode: int, log: str) -> None:
        super().__init__(f"{name} exited with {returncode}:\n{log}")
        self.returncode = returncode


@dataclass(frozen=True, slots=True)
class Launch:
    name: str  # "tierserve", "vllm", "llamacpp"
    command: list[str]
    env: dict[str, str]  # on top of ours (a peer's: on top of ours less PYTHONPATH and VIRTUAL_ENV)
    health_path: str  # answers 200 once the model is loaded
    ready_timeout_s: float
    dtype: str  # what it computes in, for the figures


def cores() -> int:
    return os.cpu_count() or 1


def vllm_dtype(precision: Precision) -> str:
    """vLLM-CPU's fastest dtype here: bfloat16 where the CPU has native bf16, else float32."""
    if precision is Precision.FP32:
        return "float32"
    return "bfloat16" if cpu_caps().native_bf16 else "float32"


def tierserve_launch(
    precision: Precision,
    workdir: Path,
    path: str = DEFAULT_MODEL_PATH,
    policies: str = DEFAULT_SET,
    threads: int | None = None,
) -> Launch:
    """``tierserve serve`` with one pool of ``path`` (the embedded model unless told): dtype auto (best)
    or float32; its worker policies the ``policies`` set (loadtest.policy_sets: the defaults unless told);
    ``threads``: its worker's (OMP_NUM_THREADS, which serve then leaves to the worker), else every core."""
    dtype = "float32" if precision is Precision.FP32 else "auto"
    config = workdir / "tierserve.toml"
    config.write_text(
        f'[[models.pools]]\nname = "{MODEL}"\npath = {json.dumps(path)}\ndtype = "{dtype}"\n'
        f"kv_cache_gb = {KV_CACHE_GB}\n{POLICY_SETS[policies]}"
    )
    port = free_port()
    command = [sys.executable, "-m", "tierserve", "serve", "--host", HOST, "--port", str(port)]
    env = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
    return Launch("tierserve", [*command, "--config", str(config)], env, "/ready", TIERSERVE_READY_S, dtype)


@dataclass(frozen=True, slots=True)
class Started:
    base_url: str
    session: int  # the session (and process group) of the server and of whatever it spawned


def vllm_launch(
    python: Path,
    model_dir: Path,
    precision: Precision,
    preload: Sequence[Path] = (),
    extra_env: Mapping[str, str] | None = None,
    threads: int | None = None,
) -> Launch:
    """vLLM-CPU's OpenAI server; ``extra_env``: more variables (the ISA cap of ``peers_isa``);
    ``threads``: its OpenMP threads, bound to the first cores (else every core)."""
    dtype = vllm_dtype(precision)
    port = free_port()
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", MODEL, "--dtype", dtype,
        "--max-model-len", str(VLLM_MAX_MODEL_LEN), "--scheduling-policy", "priority",
        "--host", HOST, "--port", str(port),
    ]  # fmt: skip
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(threads or cores()) - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GB),
        "HF_HUB_OFFLINE": "1",  # a local folder; no model hub is reachable, so never ask one
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if preload:  # tcmalloc and Intel's OpenMP, as vLLM-CPU's installation guide asks
        env["LD_PRELOAD"] = ":".join(str(library) for library in preload)
    return Launch("vllm", command, {**env, **(extra_env or {})}, "/health", VLLM_READY_S, dtype)


def llamacpp_launch(binary: Path, gguf: Path, threads: int | None = None) -> Launch:
    """llama.cpp's server on ``threads`` threads (else every core)."""
    port = free_port()
    command = [
        str(binary), "-m", str(gguf), "-t", str(threads or cores()), "-c", str(LLAMACPP_CONTEXT),
        "--parallel", str(LLAMACPP_SLOTS), "--cont-batching",
        # One KV pool shared by the slots: without it each of 32 slots holds only 16384 / 32 = 512
        # tokens, and the mixed-tier workload's long prompts would not fit.
        "--kv-unified",
        "--host", HOST, "--port", str(port),
    ]  # fmt: skip
    return Launch("llamacpp", command, {}, "/health", LLAMACPP_READY_S, "q4_1")


def port_of(launch: Launch) -> str:
    return launch.command[launch.command.index("--port") + 1]


def server_env(launch: Launch, inherited: Mapping[str, str]) -> dict[str, str]:
    """``launch``'s environment: ours (``inherited``) with its own on top. Each server's threads are its
    launch's alone (a caller's OMP_NUM_THREADS would otherwise reach whichever server heeds it), and a
    peer runs in its own venv or none: nothing of ours leaks in."""
    env = dict(inherited)
    env.pop("OMP_NUM_THREADS", None)
    if launch.name != "tierserve":
        for key in ("PYTHONPATH", "VIRTUAL_ENV"):
            env.pop(key, None)
    return {**env, **launch.env}


@contextmanager
def running(launch: Launch, log_path: Path) -> Iterator[Started]:
    """Start ``launch``, yield it once its health endpoint answers 200; the process group is stopped
    on the way out whatever happened. A server that exits or is not ready in time raises."""
    env = server_env(launch, os.environ)
    base_url = f"http://{HOST}:{port_of(launch)}"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            launch.command,
            cwd=ROOT if launch.name == "tierserve" else log_path.parent,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_healthy(process, base_url + launch.health_path, launch, log_path)
        yield Started(base_url, process.pid)
    finally:
        stop_server(process)


def _wait_healthy(process: subprocess.Popen[bytes], url: str, launch: Launch, log_path: Path) -> None:
    deadline = time.monotonic() + launch.ready_timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServerExited(launch.name, process.returncode, log_tail(log_path))
            with suppress(httpx.TransportError):
                if client.get(url).status_code == 200:
                    return
            time.sleep(POLL_INTERVAL_S)  # the interval of a deadline-bounded poll
    raise TimeoutError(
        f"{launch.name}: {url} not 200 after {launch.ready_timeout_s:g} s:\n{log_tail(log_path)}"
    )
