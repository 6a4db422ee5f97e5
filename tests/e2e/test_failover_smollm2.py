"""Failover with the real model: two SmolLM2 workers under ``tierserve serve``, one ``kill -9``ed mid-stream.

The mock fleet (``test_failover.py``) proves the bookkeeping; this proves the model side of a migration:
the surviving worker prefills prompt + the tokens the client already has (``resumed_token_ids``) and
must pick, greedily, exactly the tokens the dead worker would have decoded one by one. Every client
transcript is compared, byte for byte, with the no-failure transcript of the same prompt taken from the
same server before any kill; ``usage.completion_tokens`` and the finish must be the reference's too.

Why exact: the surviving worker computes the resumed tokens as the output rows they were
(``Request.outputs_from``: decode rows, their blocks hashed as output), and the fused CPU layer's steps
are batch-invariant (docs/kernels.md), so its continuation is the same bits as the dead worker's, in
the default weights (the embedded Q4_1 GGUF served natively) as in float32. Before that (resumed tokens
computed as prompt rows, in tiles) float32 agreed at 64 of 64 measured resume points only because its
top-1/top-2 gaps were wider than the 1.4e-5 the two orders of summation differed by; bfloat16 diverged
at 24 of 64. So the comparison is exact, not tolerant, and the pool serves the Q4_1 GGUF (``default-q4_1``,
as ``make serve`` does). Not bfloat16: its steps past 32 rows with a prompt's rows in them leave the
fused layer (docs/kernels.md), and a pool ``path = "default"`` serves bfloat16 on a CPU with it.

Each trial: 4 streams of 4 of the reference prompts (seeded choice), a random one of them watched; after
a random number of its chunks (tokens are flowing on both workers), SIGKILL a worker that is running
streams, start a replacement with the command line serve gives its workers, and wait for both workers
to be ready before the next trial. The moment is counted in chunks, not seconds, so a slow CI machine
moves it nowhere. ``TRIALS`` (3) keeps ``make test`` short on two cores;
``TIERSERVE_FAILOVER_SMOLLM2_TRIALS=20`` runs more, ``TIERSERVE_FAILOVER_SEED`` another random
sequence (a failure names its trial and seed).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.worker_procs import policies_arg, pool_args
from loadtest.failover_bench import (
    Fleet,
    StreamResult,
    metric,
    num_ready,
    scrape,
    serve_worker_address,
    stream_completion,
    wait_for,
)
from loadtest.launch import log_tail, running_server
from wire.config import ServerConfig, load_config
from worker.models.store import pull_default_model, resolve_model

pytestmark = pytest.mark.slow

TRIALS_ENV = "TIERSERVE_FAILOVER_SMOLLM2_TRIALS"
TRIALS = int(os.environ.get(TRIALS_ENV, "3"))
SEED = int(os.environ.get("TIERSERVE_FAILOVER_SEED", "6"))
MODEL = "smollm2"  # the pool's served name
NUM_WORKERS = 2
STREAMS_PER_TRIAL = 4  # least-loaded routing puts two on each worker
# Long enough that, at ~10 ms a token, no stream ends before the watched one reaches its kill point
# (at most a quarter of the way): at 40 tokens a stream once did.
MAX_TOKENS = 96
# Two workers of two torch threads each on two busy cores spend their steps in OpenMP barriers waiting
# for each other's threads (4 streams: 8 s with one thread each, 60-120 s with two): one thread each.
WORKER_ENV = {"OMP_NUM_THREADS": "1"}
HEARTBEAT_TIMEOUT_S = 2.0  # gateway.heartbeat_timeout_s for this server (workers heartbeat every 0.5 s)
READY_TIMEOUT_S = 300.0  # workers importing torch and packing the weights on a busy 2-core box
CONFIG = f"""
[gateway]
heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}

[[models.pools]]
name = "{MODEL}"
path = "default-q4_1"
num_workers = {NUM_WORKERS}
kv_cache_gb = 0.25
max_num_seqs = 8
max_num_batched_tokens = 512
"""
# Raw completions (no chat template) that run to max_tokens without an end-of-text token.
PROMPTS = [
    "The history of the printing press begins",
    "Here is a recipe for a simple tomato soup:",
    "The three laws of motion describe",
    "Once upon a time, in a village by the sea,",
    "A bicycle gear works by",
    "Photosynthesis is the process by which",
]


@dataclass(kw_only=True)
class SmolFleet(Fleet):
    """serve's two workers, and the replacements this test starts the way serve starts its own."""

    config: ServerConfig
    model_path: Path

    def spawn(self, worker_id: str) -> None:
        """A worker started as serve starts its own (``gateway/worker_procs.py`` ``spawn``)."""
        pool = self.config.models.pools[0]
        args = [
            "--served-name",
            MODEL,
            *pool_args(pool),
            *policies_arg(self.config),
            "--model",
            str(self.model_path),
        ]
        self.start(worker_id, args, env={**os.environ, **WORKER_ENV})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmolFleet]:
    pull_default_model()
    model_path = resolve_model("default-q4_1")  # the folder serve gives its workers
    tmp = tmp_path_factory.mktemp("failover-smollm2")
    config_path = tmp / "tierserve.toml"
    config_path.write_text(CONFIG)
    log_path = tmp / "serve.log"
    with pytest.MonkeyPatch.context() as env:
        for name, value in WORKER_ENV.items():
            env.setenv(name, value)  # serve gives its workers its own environment
        with running_server(["--config", str(config_path)], log_path, READY_TIMEOUT_S) as server:
            wait_for(
                lambda: num_ready(server.base_url, MODEL) == NUM_WORKERS,
                READY_TIMEOUT_S,
                "both workers ready",
            )
            fleet = SmolFleet(
                server=server,
                address=serve_worker_address(log_path, MODEL),
                log_dir=tmp,
                config=load_config(str(config_path)),
                model_path=model_path,
            )
            try:
                yield fleet
            finally:
                fleet.close()


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=READY_TIMEOUT_S, limits=httpx.Limits(max_connections=16))


async def _references(base_url: str) -> dict[str, StreamResult]:
    """Every prompt's no-failure stream, all at once on the two workers (batching does not change a
    bit of the output: tests/worker/test_batch_invariance.py)."""
    async with _client() as http:
        results = await asyncio.gather(
            *(stream_completion(http, base_url, p, MAX_TOKENS, model=MODEL) for p in PROMPTS)
        )
    return {r.prompt: r for r in results}


def _check(result: StreamResult, reference: StreamResult, context: str) -> list[str]:
    """What is wrong with one stream (nothing, for a correct one)."""
    problems = []
    if result.error is not None:
        problems.append(f"error {result.error}")
    if result.text != reference.text:
        at = next(
            (i for i, (a, b) in enumerate(zip(result.text, reference.text, strict=False)) if a != b), None
        )
        problems.append(f"text differs from char {at}: got {result.text!r}, want {reference.text!r}")
    if result.completion_tokens != reference.completion_tokens:
        problems.append(f"completion_tokens {result.completion_tokens}, want {reference.completion_tokens}")
    if result.finish_reason != reference.finish_reason:
        problems.append(f"finish_reason {result.finish_reason}, want {reference.finish_reason}")
    return [f"{context} {result.prompt!r}: {p}" for p in problems]


def _paused_at(result: StreamResult, killed_at: float) -> int | None:
    """How many chunks a stream had when it fell silent, from the kill, for at least the heartbeat
    timeout (None: it did not). A migrated stream is silent until the gateway ejects the dead worker;
    a stream on the survivor only when a booting replacement starves it of CPU."""
    before = [t for t in result.chunk_times if t < killed_at]
    after = [t for t in result.chunk_times if t >= killed_at]
    if before and after and after[0] - before[-1] >= HEARTBEAT_TIMEOUT_S:
        return len(before)
    return None


def _running(base_url: str, worker_ids: list[str]) -> list[str]:
    """The workers whose last heartbeat showed a request running."""
    text = scrape(base_url)
    return [w for w in worker_ids if metric(text, "tierserve_worker_requests_running", worker=w) >= 1]


def _idle(base_url: str, worker_ids: list[str]) -> bool:
    """Every worker's last heartbeat showed nothing running or waiting. Waited for before a trial, so
    that no heartbeat of the previous trial's streams is left: routing (which counts the larger of the
    reported and the gateway's own load) then splits the streams two and two, and a worker that
    ``_running`` names has streams of this trial."""
    text = scrape(base_url)
    return all(
        metric(text, "tierserve_worker_requests_running", worker=w)
        + metric(text, "tierserve_worker_requests_waiting", worker=w)
        == 0
        for w in worker_ids
    )


@pytest.mark.timeout(2 * READY_TIMEOUT_S + 180 * TRIALS)
def test_kill_9_a_smollm2_worker_mid_stream_keeps_every_greedy_transcript_exact(fleet: SmolFleet) -> None:
    base_url = fleet.server.base_url
    references = asyncio.run(_references(base_url))
    for ref in references.values():  # the prompts were chosen to run to max_tokens: kills land mid-stream
        assert ref.is_complete, (ref.prompt, ref.text, ref.finish_reason, ref.error)

    rng = random.Random(SEED)
    problems: list[str] = []
    start = scrape(base_url)

    async def trial(i: int) -> str:
        prompts = rng.sample(PROMPTS, STREAMS_PER_TRIAL)
        watched = rng.choice(prompts)
        kill_after = rng.randint(2, MAX_TOKENS // 4)  # chunks of the watched stream: well before its end
        pick = rng.random()  # drawn now, so the seed's later draws do not depend on what is running
        reached = asyncio.Event()

        def on_chunk(result: StreamResult) -> None:
            if result.prompt == watched and len(result.chunk_times) >= kill_after:
                reached.set()

        async with _client() as http:
            tasks = [
                asyncio.create_task(
                    stream_completion(http, base_url, p, MAX_TOKENS, model=MODEL, on_chunk=on_chunk)
                )
                for p in prompts
            ]
            waiter = asyncio.create_task(reached.wait())
            await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not reached.is_set():  # a stream ended before the watched one reached the kill point
                ended = [t.result() for t in tasks if t.done()]
                raise AssertionError(f"trial {i}: a stream ended before the kill: {ended}")
            live = sorted(fleet.live())
            candidates = await asyncio.to_thread(_running, base_url, live) or live  # none yet: both run two
            victim = candidates[int(pick * len(candidates))]
            fleet.kill(victim)
            killed_at = time.monotonic()
            fleet.spawn(f"spare-{i}")  # boots while this trial finishes
            results = await asyncio.gather(*tasks)
        context = f"trial {i} (seed {SEED}, killed {victim} after {kill_after} chunks of {watched!r})"
        for result in results:
            problems.extend(_check(result, references[result.prompt], context))
        print(
            f"{context}: chunks before a pause of the ejection: {[_paused_at(r, killed_at) for r in results]}"
        )
        return context

    for i in range(TRIALS):
        wait_for(
            lambda: num_ready(base_url, MODEL) == NUM_WORKERS, READY_TIMEOUT_S, f"2 workers before trial {i}"
        )
        wait_for(lambda: _idle(base_url, sorted(fleet.live())), 10, f"idle workers before trial {i}")
        before = scrape(base_url)
        context = asyncio.run(trial(i))
        after = scrape(base_url)
        moved = metric(after, "tierserve_migrations_total", model=MODEL) - metric(
            before, "tierserve_migrations_total", model=MODEL
        )
        if moved < 1:  # the victim was running streams: they must have moved
            problems.append(f"{context}: no request migrated")

    end = scrape(base_url)
    lost = metric(end, "tierserve_workers_lost_total") - metric(start, "tierserve_workers_lost_total")
    migrations = metric(end, "tierserve_migrations_total", model=MODEL) - metric(
        start, "tierserve_migrations_total", model=MODEL
    )
    print(f"{TRIALS} trials: {int(migrations)} requests migrated, {int(lost)} workers lost")
    assert not problems, "\n".join(
        [*problems[:20], "serve's log ends with:", log_tail(fleet.log_dir / "serve.log")]
    )
    assert lost >= TRIALS, lost
