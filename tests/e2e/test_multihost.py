"""A fleet on three namespaced hosts, through the real CLI: ``tierserve bench multihost --json``.

A gateway and two mock workers in network namespaces of their own, over TCP with CURVE; streams in
flight from a client inside the gateway's namespace; one worker's link goes down for 6 s (longer than
ZeroMQ's 5 s heartbeat, so the old connection is given up and the worker must register again), then
comes back. The bench's figures must show nothing lost or repeated, the lost worker's streams moved,
the worker readmitted and serving, and nothing (namespaces, processes) left behind. Skipped where
this process may not create network namespaces (not root, or ``ip netns add`` refused).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import netns
from loadtest.launch import ROOT

pytestmark = pytest.mark.timeout(150)

STREAMS = 6
MAX_TOKENS = 150  # 3 s per stream at 20 ms a step: past the cut, the detection and the migration
WAVE2_TOKENS = 20
HEARTBEAT_TIMEOUT_S = 1.5
RUN_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def permitted() -> None:
    reason = netns.why_not_permitted()
    if reason is not None:
        pytest.skip(reason)


def test_a_worker_host_losing_its_link_loses_nothing_and_is_readmitted(
    permitted: None, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "tierserve", "bench", "multihost", "--json",
               "--streams", str(STREAMS), "--max-tokens", str(MAX_TOKENS),
               "--wave2-tokens", str(WAVE2_TOKENS), "--cut-after-chunks", "10", "--down-s", "6",
               "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), "--log-dir", str(tmp_path)]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:  # out of time: SIGTERM unwinds it as Ctrl-C does (its teardown runs)
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()  # what it leaves, the next bench sweeps (netns.sweep_stale)
                process.wait()
    assert process.returncode == 0, stderr[-4000:]
    figures = json.loads(stdout.strip().splitlines()[-1])

    assert figures["hosts"] == 3
    assert figures["curve"] is True
    assert figures["requests"] == 2 * STREAMS
    assert figures["tokens"] == STREAMS * (MAX_TOKENS + WAVE2_TOKENS)
    assert figures["lost_requests"] == 0
    assert figures["duplicated_tokens"] == 0
    assert figures["mismatched_streams"] == 0
    # Every stream placed on w1 was running at the cut and moved, once; only w1 was lost.
    assert figures["affected_streams"] >= 1
    assert figures["migrated"] == figures["affected_streams"]
    assert figures["workers_lost"] == 1
    # Found by silence: nothing told the gateway before its heartbeat timeout ran out (the last frames
    # in flight may have landed a step after the cut), and the streams resumed after that.
    assert figures["detect_s"] >= HEARTBEAT_TIMEOUT_S - 0.25
    assert figures["recovery_s"] >= HEARTBEAT_TIMEOUT_S - 0.25
    # Readmitted after a new link (a second Register), and given new streams again.
    assert figures["readmit_s"] > 0
    assert figures["registrations_w1"] == 2
    assert figures["served_after_readmit"] >= 1
    assert figures["switch_bytes"] > 0  # the workers' traffic crossed the namespaces' bridge

    assert not [name for name in netns.namespaces() if name.startswith(f"{netns.PREFIX}-{process.pid}-")]
    assert not _processes_mentioning(str(tmp_path))  # the workers' command lines name their log files


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue  # exited meanwhile
    return found
