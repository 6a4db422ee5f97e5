"""``tierserve worker --tensor-parallel-size 3`` serving the embedded model's float folder through a real
gateway (``serve --no-workers``), driven by the official openai client: its answer is the unsharded
engine's, and killing one of its ranks takes the whole worker down at once.

    gateway: serve --no-workers, a pool "smollm2" (path default, float32)
    worker:  python -m worker.cli worker --tensor-parallel-size 3   (rank 0; ranks 1 and 2 its children)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from loadtest.failover_bench import num_ready, process_state
from loadtest.launch import ROOT, free_port, log_tail, running_server
from wire.sampling import SamplingParams
from worker.models.store import default_model_dir, is_pulled

POOL = "smollm2"
MAX_TOKENS = 16
QUESTION = "What is the capital of France?"
START_TIMEOUT_S = 240.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not is_pulled(default_model_dir()), reason="run `tierserve models pull`"),
]


def rank_pids(log: Path) -> list[int]:
    """Ranks 1..N-1's processes, as the worker logged them when it started them."""
    found = re.search(r"ranks \[[\d, ]+\] in processes \[([\d, ]+)\]", log.read_text())
    assert found, f"the worker never named its ranks' processes:\n{log_tail(log)}"
    return [int(pid) for pid in found.group(1).split(",")]


def engine_text() -> str:
    """The unsharded engine on the same weights, on the same (torch) path."""
    from gateway.tokenizer import HFPromptBuilder
    from worker.config import EngineConfig
    from worker.engine import Engine

    engine = Engine.from_config(EngineConfig(model="default", dtype="float32", cpu_kernels=False))
    ids = HFPromptBuilder(default_model_dir()).chat_ids([{"role": "user", "content": QUESTION}])
    return engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].text


def test_a_three_rank_worker_answers_as_one_engine_and_dies_with_a_rank(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "tierserve.toml"
    config.write_text(
        f'[gateway]\nworker_address = "{address}"\n\n'
        f'[[models.pools]]\nname = "{POOL}"\npath = "default"\ndtype = "float32"\n'
    )
    worker_log = tmp_path / "worker.log"
    with worker_log.open("wb") as log:  # dials first: the gateway is ready once a worker registers
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "worker", "--connect", address, "--worker-id", "tp",
             "--served-name", POOL, "--model", "default", "--dtype", "float32", "--kv-cache-gb", "0.25",
             "--tensor-parallel-size", "3", "--no-calibrate"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    try:
        with running_server(
            ["--no-workers", "--config", str(config)], tmp_path / "gateway.log", START_TIMEOUT_S
        ) as server:
            assert num_ready(server.base_url, POOL) == 1
            ranks = rank_pids(worker_log)
            assert len(ranks) == 2, ranks
            with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120) as client:
                answer = client.chat.completions.create(
                    model=POOL, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS,
                    temperature=0,
                )  # fmt: skip
            assert answer.choices[0].message.content == engine_text()

            os.kill(ranks[0], signal.SIGKILL)
            assert worker.wait(timeout=30) == 1  # at once, not at the next collective's timeout
            assert "exited with code -9: this worker stops" in worker_log.read_text()
            deadline = time.monotonic() + 30
            while any(process_state(pid) not in ("gone", "Z") for pid in ranks):
                assert time.monotonic() < deadline, "a rank outlived its worker"
                time.sleep(0.1)  # the poll interval of a deadline-bounded wait
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait(timeout=30)
