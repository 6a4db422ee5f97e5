"""Fairness between tenants of one tier across two gateways sharing one worker, as real processes.

    gateway A: serve --mock 1 --no-workers  ◀── tenant "heavy": a flood, all of it sent on to the worker
    gateway B: serve --mock 1 --no-workers  ◀── tenant "light": a few requests, once the flood is queued
    worker fair-0: worker --mock --connect A --connect B --max-num-seqs 2 --policies {ordering: ...}

Neither gateway sees the other's traffic: only the worker's ordering can put light's requests ahead of
heavy's backlog. Under ``tiered`` (tenant-fair within the tier) light's requests take the next free
sequences and finish while most of the flood still waits; under ``fcfs`` (the control) they finish
behind it. Behaviour only, never a wall-clock bound: each wait is on a condition under a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.failover_bench import metric, num_ready, scrape, wait_for
from loadtest.launch import Server, running_server

pytestmark = pytest.mark.timeout(120)

START_TIMEOUT_S = 60.0
NUM_HEAVY = 24
NUM_LIGHT = 3
HEAVY_TOKENS = 60  # 0.6 s of 10 ms mock steps each: two run at a time
WAITING = "tierserve_worker_requests_waiting"  # from the worker's heartbeats
TENANTS = """
[[tenants]]
name = "heavy"
api_keys = ["heavy-key"]

[[tenants]]
name = "light"
api_keys = ["light-key"]
"""


@contextlib.contextmanager
def two_gateways_one_worker(tmp: Path, ordering: str) -> Iterator[tuple[Server, Server]]:
    """Gateway A (seats for the whole flood), gateway B, and one mock worker dialling both."""
    addresses = [f"ipc://{tmp}/{name}.ipc" for name in "ab"]
    policies = json.dumps({"ordering": {"name": ordering, "params": {}}})
    with contextlib.ExitStack() as stack:
        log = stack.enter_context((tmp / "worker.log").open("wb"))
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "worker", "--mock", "--worker-id", "fair-0",
             "--connect", addresses[0], "--connect", addresses[1], "--max-num-seqs", "2",
             "--mock-step-ms", "10", "--policies", policies],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )  # fmt: skip
        stack.callback(_stop, worker)
        gateways = []
        for name, address, factor in zip("ab", addresses, (NUM_HEAVY, 2), strict=True):
            config = tmp / f"{name}.toml"
            config.write_text(
                f'[gateway]\nworker_address = "{address}"\ncache_salt_secret = "fleet"\n'
                f"max_in_flight_factor = {factor}\n{TENANTS}"
            )
            args = ["--mock", "1", "--no-workers", "--config", str(config)]
            gateways.append(stack.enter_context(running_server(args, tmp / f"{name}.log", START_TIMEOUT_S)))
        wait_for(lambda: all(num_ready(g.base_url) == 1 for g in gateways), START_TIMEOUT_S, "worker ready")
        yield gateways[0], gateways[1]
        assert worker.poll() is None, "the worker exited"


def _stop(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.kill()
    worker.wait(timeout=30)


async def complete(base_url: str, key: str, prompt: str, max_tokens: int, done: list[str]) -> None:
    """One completion; its prompt is appended to ``done`` when it has finished."""
    body = {"model": "mock", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=90) as client:
        response = await client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    done.append(prompt)


def finish_order(gateway_a: Server, gateway_b: Server) -> tuple[list[str], int]:
    """The prompts in the order they finished, and how many had finished when light's were sent."""

    async def main() -> tuple[list[str], int]:
        done: list[str] = []
        flood = [
            asyncio.create_task(complete(gateway_a.base_url, "heavy-key", f"heavy {i}", HEAVY_TOKENS, done))
            for i in range(NUM_HEAVY)
        ]
        # The flood is on the worker (2 running, the rest waiting there, as B's view of it says).
        deadline = time.monotonic() + START_TIMEOUT_S
        while metric(await asyncio.to_thread(scrape, gateway_b.base_url), WAITING) < NUM_HEAVY // 2:
            assert time.monotonic() < deadline, "the flood was never seen queued on the worker"
            await asyncio.sleep(0.05)  # the poll interval of a condition wait
        num_done_before = len(done)
        light = [complete(gateway_b.base_url, "light-key", f"light {i}", 8, done) for i in range(NUM_LIGHT)]
        await asyncio.gather(*light, *flood)
        return done, num_done_before

    return asyncio.run(main())


@pytest.mark.parametrize("ordering", ["tiered", "fcfs"])
def test_a_flood_through_one_gateway_does_not_queue_a_light_tenant_of_the_other(
    tmp_path: Path, ordering: str
) -> None:
    with two_gateways_one_worker(tmp_path, ordering) as (gateway_a, gateway_b):
        order, num_done_before = finish_order(gateway_a, gateway_b)
    last_light = max(i for i, prompt in enumerate(order) if prompt.startswith("light"))
    # Heavy's requests that finished after light's were sent and before the last of light's did.
    overtaking = [p for p in order[num_done_before:last_light] if p.startswith("heavy")]
    num_left = NUM_HEAVY - num_done_before
    if ordering == "tiered":
        # Light takes the next free sequences (sharing them with heavy), ahead of heavy's backlog.
        assert len(overtaking) <= num_left // 3, order
    else:
        assert len(overtaking) == num_left, order  # the control: behind all of it
