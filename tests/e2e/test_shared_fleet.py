"""Several gateways sharing one fleet, as real processes, driven by the official openai client.

    gateway A: serve --mock 2 --no-workers   (worker_address ipc://…/a.ipc) ─┐
    gateway B: serve --mock 2 --no-workers   (worker_address ipc://…/b.ipc) ─┤
    worker shared-0 / shared-1: worker --mock --connect A --connect B ◀──────┘

Requests go through both gateways at once, so each worker runs both gateways' requests in the same
steps; every stream must be the mock's greedy transcript, byte for byte (``MockModel.transcript``).
Then gateway A is SIGKILLed mid-stream: B's streams finish exactly, the workers keep running, and B
keeps serving. Every wait is on a condition (a chunk, a metric) under a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from loadtest.failover_bench import metric, num_ready, scrape, wait_for
from loadtest.launch import Server, running_server
from worker.mock import MockModel, MockTokenizer

pytestmark = pytest.mark.timeout(180)

NUM_WORKERS = 2
STREAMS_PER_GATEWAY = 8
START_TIMEOUT_S = 90.0  # two gateways and two workers importing their stacks on a busy 2-core box
TOKENIZER = MockTokenizer()
MODEL = MockModel()


def expected_text(prompt: str, max_tokens: int) -> str:
    return TOKENIZER.decode(MODEL.transcript(TOKENIZER.encode(prompt), max_tokens), skip_special_tokens=True)


@dataclass
class SharedFleet:
    gateways: list[Server]
    workers: list[subprocess.Popen[bytes]]


@contextlib.contextmanager
def shared_fleet(tmp: Path) -> Iterator[SharedFleet]:
    """Two gateways without workers of their own, and two mock workers dialling both."""
    addresses = [f"ipc://{tmp}/{name}.ipc" for name in "ab"]
    workers = []
    with contextlib.ExitStack() as stack:
        for i in range(NUM_WORKERS):
            log = stack.enter_context((tmp / f"worker-{i}.log").open("wb"))
            worker = subprocess.Popen(
                [sys.executable, "-m", "worker.cli", "worker", "--mock", "--worker-id", f"shared-{i}",
                 "--connect", addresses[0], "--connect", addresses[1], "-v"],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )  # fmt: skip
            workers.append(worker)
            stack.callback(_stop, worker)
        gateways = []
        for name, address in zip("ab", addresses, strict=True):
            config = tmp / f"{name}.toml"
            # One cache salt key for both, so a tenant's cached prefixes count whichever gateway it uses.
            config.write_text(f'[gateway]\nworker_address = "{address}"\ncache_salt_secret = "fleet"\n')
            args = ["--mock", str(NUM_WORKERS), "--no-workers", "--config", str(config)]
            gateways.append(
                stack.enter_context(running_server(args, tmp / f"gateway-{name}.log", START_TIMEOUT_S))
            )
        urls = [gateway.base_url for gateway in gateways]
        wait_for(lambda: all(num_ready(url) == NUM_WORKERS for url in urls), START_TIMEOUT_S, "workers ready")
        yield SharedFleet(gateways, workers)
        assert [w.poll() for w in workers] == [None] * NUM_WORKERS, "a worker exited"


def _stop(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.kill()
    worker.wait(timeout=30)


@dataclass
class Result:
    prompt: str
    max_tokens: int
    worker: str = ""  # x-tierserve-worker
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None

    def problems(self) -> list[str]:
        found = []
        if self.error is not None:
            found.append(f"error {self.error}")
        if self.text != expected_text(self.prompt, self.max_tokens):
            found.append(f"text differs: {self.text!r}")
        if (self.finish_reason, self.completion_tokens) != ("length", self.max_tokens):
            found.append(f"finish {self.finish_reason}, {self.completion_tokens} tokens")
        return [f"{self.prompt!r}: {p}" for p in found]


async def stream(
    client: openai.AsyncOpenAI, prompt: str, max_tokens: int, first_chunk: asyncio.Event | None = None
) -> Result:
    """One greedy streamed completion; a broken stream is recorded, not raised."""
    result = Result(prompt, max_tokens)
    try:
        raw = await client.completions.with_raw_response.create(
            model="mock", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        result.worker = raw.headers["x-tierserve-worker"]
        async for chunk in raw.parse():
            for choice in chunk.choices:
                result.text += choice.text
                result.finish_reason = choice.finish_reason or result.finish_reason
                if first_chunk is not None and choice.text:
                    first_chunk.set()
            if chunk.usage is not None:
                result.completion_tokens = chunk.usage.completion_tokens
    except openai.OpenAIError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=60, max_retries=0)


def test_two_gateways_serve_one_fleet_at_once(tmp_path: Path) -> None:
    with shared_fleet(tmp_path) as fleet:

        async def run() -> list[list[Result]]:
            clients = [client(g) for g in fleet.gateways]
            try:
                return await asyncio.gather(
                    *(
                        asyncio.gather(
                            *(
                                stream(c, f"gateway {g} stream {j}", 40 + 10 * j)
                                for j in range(STREAMS_PER_GATEWAY)
                            )
                        )
                        for g, c in enumerate(clients)
                    )
                )
            finally:
                for c in clients:
                    await c.close()

        results = asyncio.run(run())
        problems = [p for per_gateway in results for r in per_gateway for p in r.problems()]
        assert not problems, "\n".join(problems)
        workers = {f"shared-{i}" for i in range(NUM_WORKERS)}
        for per_gateway in results:  # every gateway spread its requests over the whole fleet
            assert {r.worker for r in per_gateway} == workers
        for gateway in fleet.gateways:
            text = scrape(gateway.base_url)
            for worker in workers:
                assert metric(text, "tierserve_worker_up", worker=worker, state="ready") == 1


def test_one_gateway_dies_the_other_and_the_workers_go_on(tmp_path: Path) -> None:
    with shared_fleet(tmp_path) as fleet:
        doomed, survivor = fleet.gateways

        async def run() -> list[Result]:
            clients = [client(doomed), client(survivor)]
            started = asyncio.Event()
            try:
                lost = [
                    asyncio.create_task(stream(clients[0], f"doomed {j}", 400, started)) for j in range(4)
                ]
                kept = [
                    asyncio.create_task(stream(clients[1], f"kept {j}", 200))
                    for j in range(STREAMS_PER_GATEWAY)
                ]
                await asyncio.wait_for(started.wait(), 60)  # the doomed gateway's streams are running
                os.killpg(doomed.process.pid, signal.SIGKILL)
                for result in await asyncio.gather(*lost):
                    assert result.error is not None or result.finish_reason is None  # cut off, not hung
                results = await asyncio.gather(*kept)
                results.append(await stream(clients[1], "after the kill", 50))  # and new ones
                return results
            finally:
                for c in clients:
                    await c.close()

        results = asyncio.run(run())
        problems = [p for r in results for p in r.problems()]
        assert not problems, "\n".join(problems)
        assert doomed.process.wait(timeout=10) == -signal.SIGKILL
        assert [w.poll() for w in fleet.workers] == [None] * NUM_WORKERS
        assert num_ready(survivor.base_url) == NUM_WORKERS
