"""How serve starts a worker process: below the gateway's priority, tied to the gateway's life."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.worker_procs import WORKER_NICENESS, in_worker_before_exec


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
