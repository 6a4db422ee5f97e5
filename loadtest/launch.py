"""Start ``tierserve serve`` as a real subprocess on 127.0.0.1, for benchmarks and tests.

    with running_server(["--mock", "2"], tmp / "serve.log", ready_timeout_s=60) as server:
        httpx.get(f"{server.base_url}/v1/models")

The server runs in its own session (process group), so the teardown in the ``finally`` reaches its
worker processes too: SIGTERM (serve drains and stops its workers), then SIGKILL to whatever is left of
the group. Its stdout and stderr go to ``log_path``; a server that exits or is not ready in time raises
with the log's tail in the message.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.serve import ALL_READY

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
STOP_TIMEOUT_S = 20.0
LOG_TAIL_BYTES = 4000
POLL_INTERVAL_S = 0.1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class Server:
    base_url: str  # http://127.0.0.1:PORT, no trailing slash
    process: subprocess.Popen[bytes]

    def worker_pids(self) -> list[int]:
        """The worker processes serve started (its direct children; Linux /proc)."""
        pid = self.process.pid
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@contextmanager
def running_server(
    args: list[str], log_path: Path, ready_timeout_s: float, *, port: int | None = None
) -> Iterator[Server]:
    """``python -m tierserve serve --host 127.0.0.1 --port PORT *args``, yielded once ``/ready`` answers
    200 and serve has said that every worker it expects is ready (``/ready`` alone answers from the
    first one on); its whole process group is terminated, then killed, on the way out whatever
    happened."""
    port = free_port() if port is None else port
    command = [sys.executable, "-m", "tierserve", "serve", "--host", HOST, "--port", str(port), *args]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: teardown reaches the workers too
        )
    base_url = f"http://{HOST}:{port}"
    try:
        _wait_ready(process, base_url, ready_timeout_s, log_path)
        yield Server(base_url, process)
    finally:
        stop_server(process)


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (serve drains, then stops its workers), then SIGKILL whatever is left of the group."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT_S)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def log_tail(log_path: Path) -> str:
    try:
        data = log_path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-LOG_TAIL_BYTES:].decode("utf-8", errors="replace")


def _wait_ready(process: subprocess.Popen[bytes], base_url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"serve exited with {process.returncode}:\n{log_tail(log_path)}")
            with suppress(httpx.TransportError):
                if client.get(f"{base_url}/ready").status_code == 200 and _all_ready(log_path):
                    return
            time.sleep(POLL_INTERVAL_S)  # polling interval of a deadline-bounded wait, not synchronisation
    raise TimeoutError(f"{base_url} not ready, all its workers, after {timeout_s} s:\n{log_tail(log_path)}")


def _all_ready(log_path: Path) -> bool:
    """Serve's log has its line for every expected worker ready (gateway/serve.py)."""
    with suppress(OSError):
        return ALL_READY.encode() in log_path.read_bytes()
    return False
