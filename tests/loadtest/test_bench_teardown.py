"""``tierserve bench`` stopped by SIGTERM leaves none of the servers it started running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

from loadtest.launch import ROOT


def _children(pid: int) -> dict[int, str]:
    """The live child processes of ``pid``: pid → command line."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        # the fields after the command's name (which may hold spaces) in parentheses
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out[int(entry.name)] = cmdline
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_gateways_and_the_worker_it_started() -> None:
    started: dict[int, str] = {}
    bench = subprocess.Popen(
        [sys.executable, "-m", "tierserve", "bench", "fairness", "--mock", "--duration", "60"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and bench.poll() is None:
            started = _children(bench.pid)
            if sum("serve" in c for c in started.values()) == 2 and any(
                "worker" in c for c in started.values()
            ):
                break
            time.sleep(0.5)  # the poll interval of a deadline-bounded wait
        assert bench.poll() is None, "the bench ended before its fleet was up"
        assert len(started) == 3, started  # gateways A and B, one worker
        time.sleep(3)  # into the run
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(pid) for pid in started):
            time.sleep(0.5)
        assert not [started[pid] for pid in started if _alive(pid)]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in [p for p in started if _alive(p)]:  # a failed teardown leaves no process behind
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
