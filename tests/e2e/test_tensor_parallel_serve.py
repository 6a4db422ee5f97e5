"""``tierserve serve`` with a pool of ``tensor_parallel_size = 3`` (SmolLM2 has 9 attention heads: 3
splits them, 2 does not): the launcher starts two workers of three ranks each, and when one rank of a
worker running streams is ``kill -9``ed mid-stream, that whole worker goes down and its streams finish
on the other worker: every transcript byte for byte the one taken from the same server before the kill
(nothing lost or repeated), ``usage`` and finish the same.

    serve   pool "smollm2" (path default, float32, tensor_parallel_size 3, num_workers 2)
      smollm2-0   rank 0 (daemon) + ranks 1, 2 (its children)
      smollm2-1   rank 0 (daemon) + ranks 1, 2 (its children)

float32 for the reason tests/e2e/test_failover_smollm2.py gives: a resumed stream recomputes its next
token by a prefill where the lost worker would have decoded it, and only float32 keeps greedy choices
exact across the two paths. Both workers split the model the same way, so the sharded sums agree too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from loadtest.failover_bench import (
    StreamResult,
    metric,
    num_ready,
    process_state,
    scrape,
    stream_completion,
    wait_for,
    worker_processes,
)
from loadtest.launch import log_tail, running_server
from worker.models.store import default_model_dir, is_pulled

MODEL = "smollm2"
NUM_WORKERS = 2
MAX_TOKENS = 32
KILL_AFTER_CHUNKS = 8  # of the watched stream: well before its end
HEARTBEAT_TIMEOUT_S = 2.0
READY_TIMEOUT_S = 300.0  # six processes importing torch and loading 540 MB each on a busy 2-core box
CONFIG = f"""
[gateway]
heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}

[[models.pools]]
name = "{MODEL}"
path = "default"
dtype = "float32"
tensor_parallel_size = 3
num_workers = {NUM_WORKERS}
kv_cache_gb = 0.25
max_num_seqs = 8
max_num_batched_tokens = 512
"""
# Raw completions that run to max_tokens without an end-of-text token (as in test_failover_smollm2.py).
PROMPTS = [
    "The history of the printing press begins",
    "Here is a recipe for a simple tomato soup:",
    "The three laws of motion describe",
    "Photosynthesis is the process by which",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(2 * READY_TIMEOUT_S + 240),
    pytest.mark.skipif(not is_pulled(default_model_dir()), reason="run `tierserve models pull`"),
]


def rank_pids(worker_pid: int) -> list[int]:
    """A worker's other ranks: its children started by multiprocessing's spawn (not its resource
    tracker)."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    return [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=READY_TIMEOUT_S, limits=httpx.Limits(max_connections=8))


async def _all(base_url: str, on_chunk: Callable[[StreamResult], None] | None = None) -> list[StreamResult]:
    async with _client() as http:
        return await asyncio.gather(
            *(
                stream_completion(http, base_url, p, MAX_TOKENS, model=MODEL, on_chunk=on_chunk)
                for p in PROMPTS
            )
        )


def _running(base_url: str, worker_ids: list[str]) -> list[str]:
    text = scrape(base_url)
    return [w for w in worker_ids if metric(text, "tierserve_worker_requests_running", worker=w) >= 1]


def test_serve_starts_tensor_parallel_workers_and_a_lost_rank_migrates_its_streams(tmp_path: Path) -> None:
    config = tmp_path / "tierserve.toml"
    config.write_text(CONFIG)
    log_path = tmp_path / "serve.log"
    with pytest.MonkeyPatch.context() as env:
        env.delenv("OMP_NUM_THREADS", raising=False)  # serve divides the cores: 2 // 6 ranks = 1 thread
        with running_server(["--config", str(config)], log_path, READY_TIMEOUT_S) as server:
            base_url = server.base_url
            wait_for(lambda: num_ready(base_url, MODEL) == NUM_WORKERS, READY_TIMEOUT_S, "both workers")
            assert "starting 2 worker(s) of 'smollm2'" in log_path.read_text()
            assert "3 tensor-parallel ranks each" in log_path.read_text()
            workers = worker_processes(server)
            assert sorted(workers) == ["smollm2-0", "smollm2-1"], workers
            ranks = {worker_id: rank_pids(pid) for worker_id, pid in workers.items()}
            assert all(len(pids) == 2 for pids in ranks.values()), ranks

            references = {r.prompt: r for r in asyncio.run(_all(base_url))}
            for ref in references.values():
                assert ref.is_complete and ref.completion_tokens == MAX_TOKENS, ref
            wait_for(lambda: not _running(base_url, sorted(workers)), 10, "idle workers")
            before = scrape(base_url)

            async def killed_mid_stream() -> tuple[str, list[StreamResult]]:
                reached = asyncio.Event()

                def on_chunk(result: StreamResult) -> None:
                    if result.prompt == PROMPTS[0] and len(result.chunk_times) >= KILL_AFTER_CHUNKS:
                        reached.set()

                streams = asyncio.create_task(_all(base_url, on_chunk))
                await asyncio.wait_for(reached.wait(), READY_TIMEOUT_S)
                running = await asyncio.to_thread(_running, base_url, sorted(workers))
                victim = (running or sorted(workers))[0]
                os.kill(ranks[victim][0], signal.SIGKILL)  # rank 1: its worker must go down with it
                return victim, await streams

            victim, results = asyncio.run(killed_mid_stream())
            deadline = time.monotonic() + 30
            while process_state(workers[victim]) not in ("gone", "Z"):
                assert time.monotonic() < deadline, f"{victim} outlived its rank 1"
                time.sleep(0.1)  # the poll interval of a deadline-bounded wait
            after = scrape(base_url)

    problems = []
    for result in results:
        ref = references[result.prompt]
        got = (result.error, result.text, result.completion_tokens, result.finish_reason)
        want = (None, ref.text, ref.completion_tokens, ref.finish_reason)
        if got != want:
            problems.append(f"{result.prompt!r}: got {got}, want {want}")
    assert not problems, "\n".join([*problems, "serve's log ends with:", log_tail(log_path)])
    moved = metric(after, "tierserve_migrations_total", model=MODEL) - metric(
        before, "tierserve_migrations_total", model=MODEL
    )
    assert moved >= 1, f"{victim} was running streams, and none moved"
    assert metric(after, "tierserve_workers_lost_total") - metric(before, "tierserve_workers_lost_total") == 1
