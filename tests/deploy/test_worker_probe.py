"""The workers' liveness probe against real processes: a ``tierserve worker --mock`` dialling a real
``serve --no-workers`` gateway, and the probe command the manifests run.

The worker's --connect also names a gateway replica whose DNS name does not exist (a StatefulSet pod
not scheduled yet): it must not keep the worker from the gateway that is there. The mock's steps take
``STEP_S`` each, longer than the probe's ``MAX_AGE_S``: idle, the probe passes for longer than
``MAX_AGE_S``; while a request's step runs (the heartbeat thread still talking, as in a hung engine)
it fails; once the step is done it passes again. Every wait is a poll with a deadline.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from loadtest.launch import free_port, running_server

pytestmark = pytest.mark.timeout(180)

START_TIMEOUT_S = 90.0  # a gateway and a worker importing their stacks on a busy 2-core box
MAX_AGE_S = 3.0
STEP_S = 8.0
ABSENT_GATEWAY = "tcp://tierserve-gateway-9.tierserve-gateway-workers.invalid:5555"


def probe(liveness_file: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tierserve", "worker", "probe", "--liveness-file", str(liveness_file),
               "--max-age-s", str(MAX_AGE_S)]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def poll(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    pytest.fail(f"not within {timeout_s} s: {what}")


def test_an_idle_worker_passes_and_a_worker_stuck_in_a_step_fails(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    liveness_file = tmp_path / "alive"
    worker_log = tmp_path / "worker.log"
    command = [
        sys.executable, "-m", "tierserve", "worker", "--mock", "--mock-step-ms", str(STEP_S * 1000),
        "--no-calibrate", "--worker-id", "tierserve-worker-0", "--connect", f"{address},{ABSENT_GATEWAY}",
        "--liveness-file", str(liveness_file),
    ]  # fmt: skip
    with worker_log.open("wb") as log:
        worker = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    try:
        config = tmp_path / "gateway.toml"
        config.write_text(f'[gateway]\nworker_address = "{address}"\n')
        args = ["--mock", "1", "--no-workers", "--config", str(config)]
        with running_server(args, tmp_path / "gateway.log", START_TIMEOUT_S) as server:
            # Ready: the worker registered with the gateway that exists, whatever the other name does.
            idle_since = time.monotonic()
            while time.monotonic() - idle_since < 1.5 * MAX_AGE_S:
                result = probe(liveness_file)
                assert result.returncode == 0, f"an idle worker failed its probe: {result.stdout}"

            answer: list[httpx.Response] = []
            body = {"model": "mock", "prompt": "hi", "max_tokens": 1, "temperature": 0}
            request = threading.Thread(
                target=lambda: answer.append(
                    httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
                )
            )
            request.start()
            stale: list[str] = []

            def fails() -> bool:
                result = probe(liveness_file)
                stale.append(result.stdout)
                return result.returncode == 1

            poll(fails, STEP_S, "the probe failing while the step runs")
            assert "unhealthy: no progress for" in stale[-1]
            request.join(timeout=60)
            assert answer and answer[0].status_code == 200, answer
            poll(lambda: probe(liveness_file).returncode == 0, MAX_AGE_S * 2, "the probe passing again")
        assert worker.poll() is None, worker_log.read_text()[-3000:]
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait(timeout=30)
