"""A worker that cannot start: serve names the cause in one line (with the worker's log) and exits 1.

The model folder is the embedded model's, with its weights replaced by garbage: the gateway reads the
tokenizer as usual, the real worker process fails inside the engine's start, as a CPU that cannot run
a transform used to make it fail.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.launch import HOST, ROOT, free_port
from worker.models.store import default_model_dir, is_pulled

pytestmark = [
    pytest.mark.isa,
    pytest.mark.skipif(not is_pulled(default_model_dir()), reason="run `tierserve models pull`"),
]


def test_serve_says_why_a_worker_could_not_start_and_exits_1(tmp_path: Path) -> None:
    folder = tmp_path / "broken-model"
    folder.mkdir()
    for source in default_model_dir().iterdir():
        if source.name != "model.safetensors":
            (folder / source.name).symlink_to(source)
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)  # no safetensors header

    command = [sys.executable, "-m", "tierserve", "serve", "--host", HOST, "--port", str(free_port())]
    done = subprocess.run(
        [*command, "--model", str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    said = done.stderr + done.stdout
    assert done.returncode == 1, said
    assert "Traceback" not in said, said
    match = re.search(
        r"error: workers not ready: worker 'broken-model-0' exited with code 1: "
        r"cannot start: (\w+): (.+) \(log: (\S+)\); stopping",
        said,
    )
    assert match, said
    assert match.group(1) in ("SafetensorError", "HeaderTooLarge", "ValueError", "OSError"), match.group(0)
    log = Path(match.group(3))
    assert log.is_file() and log.name == "broken-model-0.log"
    text = log.read_text()
    assert "Traceback" in text and text.rstrip().splitlines()[-1].startswith("cannot start: ")
    assert f"worker logs kept in {log.parent}" in said
