"""What loading a model costs a worker's start beyond the weights: no torch._dynamo, no triton.

Both came in through the meta-device build (a random fill, the RoPE table): ~1 s of every start and
triton's leak warnings as the worker exits. Checked in a fresh interpreter, since the test process has
imported both long before.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.worker.test_models_tiny import _save_hf

CHECK = """
import sys
import torch
from worker.models.loader import load_model
model, _ = load_model(sys.argv[1], torch.float32)
assert model.cos_sin_cache.device.type == "cpu" and model.embed_tokens.weight.device.type == "cpu"
print(sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
"""


def test_loading_a_model_imports_neither_dynamo_nor_triton(tmp_path: Path) -> None:
    _save_hf("llama-gqa-untied", tmp_path)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
