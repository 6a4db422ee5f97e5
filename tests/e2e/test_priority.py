"""The body's ``priority`` (vLLM's field) orders requests within their tier, through a real server.

One mock worker with one sequence and a gateway with one seat: a standard holder runs, then a request
of priority 5 and one of priority -5 queue (same tier) at the gateway; when the seat frees, -5 goes
first. An interactive request of priority 9 goes before all of them: the tier comes first (admitted
into the overflow, it takes the holder's slot on the worker; the holder resumes after it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.failover_bench import metric, scrape, wait_for
from loadtest.launch import Server, running_server

pytestmark = pytest.mark.timeout(120)

CONFIG = """
[gateway]
max_in_flight_factor = 1.0

[[models.pools]]
name = "smollm2-135m-instruct"
max_num_seqs = 1
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("priority")
    (tmp / "t.toml").write_text(CONFIG)
    args = ["--mock", "1", "--mock-args", "--mock-step-ms 10", "--config", str(tmp / "t.toml")]
    with running_server(args, tmp / "serve.log", 60.0) as server:
        yield server


def queued(base_url: str, tier: str) -> float:
    return metric(scrape(base_url), "tierserve_admission_queue_length", model="mock", tier=tier)


def test_lower_priority_first_within_a_tier_and_the_tier_before_priority(server: Server) -> None:
    done: list[str] = []
    base_url = server.base_url

    async def send(client: httpx.AsyncClient, name: str, tokens: int, priority: int, tier: str) -> None:
        body = {
            "model": "mock",
            "prompt": name,
            "max_tokens": tokens,
            "priority": priority,
            "ignore_eos": True,
        }
        answer = await client.post("/v1/completions", json=body, headers={"x-sla-tier": tier}, timeout=60)
        assert answer.status_code == 200, (name, answer.text)
        done.append(name)

    def seats_held() -> bool:
        return metric(scrape(base_url), "tierserve_admission_seats_in_use") == 1

    async def main() -> None:
        async with httpx.AsyncClient(base_url=base_url) as client:
            tasks = [asyncio.create_task(send(client, "holder", 200, 0, "standard"))]
            await asyncio.to_thread(wait_for, seats_held, 10, "the holder admitted")
            for i, (name, priority) in enumerate([("p5", 5), ("p-5", -5)]):
                tasks.append(asyncio.create_task(send(client, name, 4, priority, "standard")))
                await asyncio.to_thread(wait_for, lambda n=i + 1: queued(base_url, "standard") == n, 10, name)
            tasks.append(asyncio.create_task(send(client, "interactive-p9", 4, 9, "interactive")))
            await asyncio.gather(*tasks)

    asyncio.run(main())
    assert done == ["interactive-p9", "holder", "p-5", "p5"]
