"""scripts/gpu_serve_check.py --dry-run: the serving half of the GPU check runs end to end on the CPU with
a tiny model (a real ``tierserve serve``, real HTTP streams), so the one GPU run is not the first time its
code executes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_serves_streams_and_compares_with_the_cpu_engine(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_serve_check.py"), "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "dry run" in report["device"], "dry-run figures must say they are meaningless"
    serve = report["serve"]
    for phase, num in (("single_stream", 4), ("concurrent_4", 4)):
        assert serve[phase]["ok"] == f"{num}/{num}", serve[phase]
        assert serve[phase]["output_tokens"] == num * serve["output_tokens_per_request"]  # ignore_eos held
    assert any("INFO worker.model_runner: engine: random-smollm2" in line for line in serve["startup_log"])
    reference = report["tp1_device_vs_cpu_reference"]
    assert reference["passed"] and all(p["first_divergence"] is None for p in reference["prompts"])
