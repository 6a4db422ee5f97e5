"""Graceful degradation end to end: ``tierserve serve --mock 1`` with a primary pool ("mock", one seat)
and a fallback pool ("mock-small"), degradation = degrade-on-slo.

The primary is saturated by a long interactive stream that holds its only seat; then a degradable
(interactive) request's predicted TTFT is unknown (it would queue and nothing has finished), which counts
as late, so it is answered by the fallback and says so; a standard (not degradable) request waits for the
primary instead; the stream that holds the primary is from the primary to its last chunk. Then the
primary's worker is killed: its circuit opens and degradable requests go to the fallback. The gateway's
/metrics is polled with deadlines; nothing sleeps for synchronisation.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from loadtest.launch import Server, running_server
from tests.e2e.mock_helpers import chat_ids, expected_text
from tests.e2e.test_overload import metric, wait_for_metric

pytestmark = pytest.mark.timeout(120)

CONFIG = """
[gateway]
max_in_flight_factor = 1.0
request_timeout_s = 60.0

[[tiers]]
name = "interactive"
rank = 0
ttft_ms = 1000.0
tpot_ms = 100.0
max_queue = 4
degradable = true

[[tiers]]
name = "standard"
rank = 1
ttft_ms = 3000.0
max_queue = 4

[[models.pools]]
name = "mock"
max_num_seqs = 1

[[models.pools]]
name = "mock-small"
role = "fallback"
max_num_seqs = 4

[policies]
degradation = "degrade-on-slo"
"""
PRIMARY, FALLBACK = "mock", "mock-small"
HOLD_TOKENS = 1000  # ~5 s of 5 ms mock steps: the primary's seat stays taken while the test works
DEGRADED_STREAM_TOKENS = 300
DEADLINE_S = 60.0


def start(tmp: Path) -> Iterator[Server]:
    (tmp / "tierserve.toml").write_text(CONFIG)
    args = ["--mock", "1", "--config", str(tmp / "tierserve.toml")]
    with running_server(args, tmp / "serve.log", ready_timeout_s=60) as server:
        yield server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from start(tmp_path)


def body(text: str, max_tokens: int, *, model: str = PRIMARY, stream: bool = False) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def tier(name: str) -> dict[str, str]:
    return {"x-sla-tier": name}


@dataclass
class Streamed:
    headers: dict[str, str] = field(default_factory=dict)
    models: set[str] = field(default_factory=set)  # the "model" of every chunk
    text: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def stream(
    client: httpx.AsyncClient, payload: dict[str, object], tier_name: str, out: Streamed
) -> None:
    async with client.stream(
        "POST", "/v1/chat/completions", json=payload, headers=tier(tier_name)
    ) as response:
        assert response.status_code == 200
        out.headers = dict(response.headers)
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                out.models.add(chunk["model"])
                out.text += [choice["delta"].get("content") or "" for choice in chunk["choices"]]
                out.started.set()


async def both_pools_ready(client: httpx.AsyncClient) -> None:
    """/ready answers once any worker is; wait for each pool's."""
    for worker in (f"{PRIMARY}-0", f"{FALLBACK}-0"):
        await wait_for_metric(client, "tierserve_worker_up", 1, worker=worker, state="ready")


def test_a_saturated_primary_degrades_degradable_tiers_only_and_never_switches_a_stream(
    server: Server,
) -> None:
    async def main() -> None:
        async with (
            asyncio.timeout(DEADLINE_S),
            httpx.AsyncClient(base_url=server.base_url, timeout=30) as client,
        ):
            await both_pools_ready(client)
            # The idle primary takes an interactive stream, which holds its only seat.
            held = Streamed()
            holder = asyncio.create_task(
                stream(client, body("hold", HOLD_TOKENS, stream=True), "interactive", held)
            )
            await held.started.wait()

            # Interactive is degradable: answered by the fallback, and marked.
            degraded = await client.post(
                "/v1/chat/completions", json=body("small one", 8), headers=tier("interactive")
            )
            assert degraded.status_code == 200, degraded.text
            assert degraded.headers["x-degraded"] == "true"
            assert degraded.headers["x-tierserve-model"] == FALLBACK
            assert degraded.headers["x-sla-tier"] == "interactive"
            assert degraded.json()["model"] == FALLBACK
            assert degraded.json()["choices"][0]["message"]["content"] == expected_text(
                chat_ids("small one"), 8
            )

            # Standard is not degradable: it waits for the primary's seat.
            waiting = asyncio.create_task(
                client.post("/v1/chat/completions", json=body("patient", 8), headers=tier("standard"))
            )
            await wait_for_metric(
                client, "tierserve_admission_queue_length", 1, model=PRIMARY, tier="standard"
            )

            # A degraded stream: every chunk from the fallback, which really runs it.
            small = Streamed()
            small_task = asyncio.create_task(
                stream(
                    client, body("small stream", DEGRADED_STREAM_TOKENS, stream=True), "interactive", small
                )
            )
            await small.started.wait()
            while metric((await client.get("/metrics")).text, "tierserve_worker_requests_running",
                         worker=f"{FALLBACK}-0") < 1:  # fmt: skip
                assert not small_task.done(), "the degraded stream ended before the fallback reported it"
                await asyncio.sleep(0.02)  # polling inside the test's deadline
            await small_task
            assert small.headers["x-degraded"] == "true" and small.models == {FALLBACK}
            assert "".join(small.text) == expected_text(chat_ids("small stream"), DEGRADED_STREAM_TOKENS)
            assert not holder.done(), "HOLD_TOKENS too short: the primary freed up during the test"

            # The stream that started on the primary stays on it to the end, whole.
            await holder
            assert held.models == {PRIMARY} and "x-degraded" not in held.headers
            assert held.headers["x-tierserve-model"] == PRIMARY
            assert "".join(held.text) == expected_text(chat_ids("hold"), HOLD_TOKENS)
            served = await waiting
            assert served.status_code == 200, served.text
            assert served.json()["model"] == PRIMARY and "x-degraded" not in served.headers

            text = (await client.get("/metrics")).text
            assert metric(text, "tierserve_degraded_total", model=PRIMARY, tier="interactive") == 2
            assert metric(text, "tierserve_degraded_total", model=PRIMARY, tier="standard") == 0
            assert (
                metric(text, "tierserve_requests_total", model=FALLBACK, tier="interactive", status="200")
                == 2
            )
            assert (
                metric(text, "tierserve_requests_total", model=PRIMARY, tier="interactive", status="200") == 1
            )
            assert metric(text, "tierserve_requests_total", model=PRIMARY, tier="standard", status="200") == 1

    asyncio.run(main())


def worker_pid(server: Server, worker_id: str) -> int:
    for pid in server.worker_pids():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if worker_id.encode() in argv:
            return pid
    raise AssertionError(f"no worker process {worker_id}")


def test_an_open_circuit_sends_degradable_tiers_to_the_fallback(server: Server) -> None:
    async def main() -> None:
        async with (
            asyncio.timeout(DEADLINE_S),
            httpx.AsyncClient(base_url=server.base_url, timeout=30) as client,
        ):
            await both_pools_ready(client)
            models = (await client.get("/v1/models")).json()
            assert sorted(card["id"] for card in models["data"]) == [PRIMARY, FALLBACK]
            # Asking for the fallback by name: served by it, not a degradation.
            direct = await client.post("/v1/chat/completions", json=body("direct", 5, model=FALLBACK))
            assert direct.status_code == 200, direct.text
            assert direct.json()["model"] == FALLBACK and "x-degraded" not in direct.headers

            os.kill(worker_pid(server, f"{PRIMARY}-0"), signal.SIGKILL)
            # The gateway declares it dead after its heartbeat timeout (3 s of silence).
            await wait_for_metric(client, "tierserve_worker_up", 1, worker=f"{PRIMARY}-0", state="dead")

            degraded = await client.post(
                "/v1/chat/completions", json=body("no primary", 5), headers=tier("interactive")
            )
            assert degraded.status_code == 200, degraded.text
            assert degraded.headers["x-degraded"] == "true" and degraded.json()["model"] == FALLBACK
            assert degraded.json()["choices"][0]["message"]["content"] == expected_text(
                chat_ids("no primary"), 5
            )
            refused = await client.post(
                "/v1/chat/completions", json=body("no primary", 5), headers=tier("standard")
            )
            assert refused.status_code == 503, refused.text  # not degradable: no worker of its model

            text = (await client.get("/metrics")).text
            assert metric(text, "tierserve_degraded_total", model=PRIMARY, tier="interactive") == 1
            assert metric(text, "tierserve_degraded_total", model=PRIMARY, tier="standard") == 0
            assert (
                metric(text, "tierserve_requests_total", model=FALLBACK, tier="standard", status="200") == 1
            )

    asyncio.run(main())
