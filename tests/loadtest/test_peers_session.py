"""The ``peers`` bench's session around a server that dies at start: llama.cpp killed by a signal on an AMX
CPU is started again from its build without ggml's AMX path, once; anywhere else the peer is reported as
failed and the bench goes on. Real processes stand in for the two llama.cpp builds (one that kills
itself, one that answers /health), so the start, the exit status and the retry are the real ones."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from loadtest import peers_bench
from loadtest.launch import free_port
from loadtest.peers_bench import _Bench, parse_args
from loadtest.peers_figures import ServerResult, server_figures
from loadtest.peers_servers import Launch, Precision

pytestmark = pytest.mark.timeout(60)

KILLED_AT_START = f"import os; os.kill(os.getpid(), {int(signal.SIGKILL)})"
ANSWERS_HEALTH = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[2])), Health).serve_forever()
"""


class Bench(_Bench):
    """The bench with its llama.cpp launches replaced: the native build dies, the no-AMX one serves."""

    def launch(self, name: str) -> Launch:
        code = ANSWERS_HEALTH if self.llamacpp_variant == "noamx" else KILLED_AT_START
        command = [sys.executable, "-c", code, "--port", str(free_port())]
        return Launch(name, command, {}, "/health", 30.0, "q4_1")


def run_session(tmp_path: Path) -> tuple[Bench, ServerResult, list[str]]:
    bench = Bench(parse_args(["--servers", "llamacpp"]), Precision.BEST, tmp_path, None, {})  # type: ignore[arg-type]
    measured: list[str] = []
    bench.session("llamacpp", "check", lambda base_url, result: measured.append(base_url))
    return bench, bench.results["llamacpp"], measured


def test_killed_at_start_on_an_amx_cpu_it_runs_again_without_its_amx_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers_bench, "has_amx", lambda: True)
    bench, result, measured = run_session(tmp_path)
    assert bench.llamacpp_variant == "noamx"
    assert len(measured) == 1 and measured[0].startswith("http://127.0.0.1:")
    assert result.error is None and result.start_s is not None
    figures = server_figures(result)
    assert (
        figures["note"]
        == f"built without ggml's AMX path: the native build died at start (-{int(signal.SIGKILL)})"
    )
    assert "error" not in figures


def test_elsewhere_a_peer_killed_at_start_is_reported_and_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers_bench, "has_amx", lambda: False)
    bench, result, measured = run_session(tmp_path)
    assert bench.llamacpp_variant == "native" and measured == []
    assert result.error is not None
    assert result.error.startswith(f"start failed: llamacpp exited with -{int(signal.SIGKILL)}")
    assert result.note is None and "note" not in server_figures(result)
