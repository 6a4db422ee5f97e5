"""scripts/gpu_bench.py --dry-run: every section of the GPU benchmark runs on CPU with tiny shapes
(Triton's interpreter), so the one GPU run is not the first time its code executes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_produces_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--dry-run", "--out", str(out)],
        check=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=300,
    )
    report = json.loads(out.read_text())
    assert "dry run" in report["device"], "dry-run figures must say they are meaningless"
    assert report["hf_equivalence_bf16"]["passed"]  # fp32 on CPU: the Triton path matches HF
    assert all(p["first_divergence"] is None for p in report["hf_equivalence_bf16"]["prompts"])
    decode = report["decode_tokens_per_s_smollm2_shape"]
    for batch in ("batch_1", "batch_2"):
        assert decode[batch]["hf_generate"] > 0 and decode[batch]["ours_eager"] > 0
    attention = report["decode_attention_bandwidth"]
    # K and V, batch 2, 64 keys, 8 kv heads of 128, bf16
    assert attention["kv_bytes_read"] == 2 * 2 * 64 * 8 * 128 * 2
    assert report["llama3_8b_shape_batch1"]["fraction_of_roofline_copy_bandwidth"] > 0
