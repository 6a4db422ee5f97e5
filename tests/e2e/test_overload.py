"""Admission end to end: one seat, per-tier queues of one, 429 + Retry-After, sheddable tiers first.

A real ``tierserve serve --mock 1`` whose worker runs one sequence at a time (``max_num_seqs = 1``,
``max_in_flight_factor = 1``): a long standard stream holds the only seat while the test queues and
sheds around it, watching the gateway's own ``/metrics``. An interactive request does not wait for
the standard one's seat: it goes into the overflow and takes the worker's slot (the standard stream
pauses and resumes, its text unchanged); the next interactive one queues, the one after is shed.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.launch import Server, running_server
from tests.e2e.mock_helpers import chat_ids, expected_text, wait_until, workers_idle

pytestmark = pytest.mark.timeout(120)

CONFIG = """
[gateway]
max_in_flight_factor = 1.0
request_timeout_s = 4.0

[[models.pools]]
name = "mock"
max_num_seqs = 1

[[tiers]]
name = "interactive"
rank = 0
max_queue = 1

[[tiers]]
name = "standard"
rank = 1
max_queue = 1

[[tiers]]
name = "batch"
rank = 2
max_queue = 4
sheddable = true
"""
HOLD_TOKENS = 400  # ~2 s of 5 ms mock steps: the seat stays taken while the test works around it
URGENT_TOKENS = 100  # ~0.5 s: it still runs while the next interactive request arrives
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("overload")
    (tmp / "tierserve.toml").write_text(CONFIG)
    args = ["--mock", "1", "--config", str(tmp / "tierserve.toml")]
    with running_server(args, tmp / "serve.log", ready_timeout_s=60) as server:
        yield server


def body(text: str, max_tokens: int, *, stream: bool = False) -> dict[str, object]:
    messages = [{"role": "user", "content": text}]
    return {
        "model": "mock",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def wait_for_metric(client: httpx.AsyncClient, name: str, value: float, **labels: str) -> None:
    while metric((await client.get("/metrics")).text, name, **labels) != value:
        await asyncio.sleep(0.02)  # polling inside the test's overall deadline


def test_queue_then_shed_with_retry_after_sheddable_first(server: Server) -> None:
    async def main() -> None:
        async with (
            asyncio.timeout(DEADLINE_S),
            httpx.AsyncClient(base_url=server.base_url, timeout=30) as client,
        ):
            first_chunk = asyncio.Event()

            async def hold() -> str:
                text = []
                async with client.stream(
                    "POST", "/v1/chat/completions", json=body("hold", HOLD_TOKENS, stream=True)
                ) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        first_chunk.set()
                        if line.startswith("data: {"):
                            for choice in httpx.Response(200, content=line[6:]).json()["choices"]:
                                text.append(choice["delta"].get("content") or "")
                return "".join(text)

            holder = asyncio.create_task(hold())
            await first_chunk.wait()
            interactive = {"x-sla-tier": "interactive"}
            urgent = asyncio.create_task(
                client.post("/v1/chat/completions", json=body("urgent", URGENT_TOKENS), headers=interactive)
            )
            await wait_for_metric(client, "tierserve_admission_seats_in_use", 2)  # into the overflow
            queued = asyncio.create_task(
                client.post("/v1/chat/completions", json=body("queued", 5), headers=interactive)
            )
            queue = "tierserve_admission_queue_length"
            await wait_for_metric(client, queue, 1, tier="interactive")
            shed = await client.post("/v1/chat/completions", json=body("no room", 5), headers=interactive)
            assert shed.status_code == 429, shed.text
            assert shed.json()["error"]["code"] == "overloaded"
            assert int(shed.headers["retry-after"]) >= 1
            # Batch is refused at once while an interactive request waits, though its own queue is empty.
            batch = await client.post(
                "/v1/chat/completions", json=body("batch", 5), headers={"x-sla-tier": "batch"}
            )
            assert batch.status_code == 429 and "more urgent" in batch.json()["error"]["message"]
            # A queued client that gives up leaves the queue (standard's queue of one is free again).
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/chat/completions", json=body("impatient", 5), timeout=0.5)
            await wait_for_metric(client, queue, 0, tier="standard")
            held = await holder
            for answer, text, n in ((await urgent, "urgent", URGENT_TOKENS), (await queued, "queued", 5)):
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-sla-tier"] == "interactive"
                assert answer.json()["choices"][0]["message"]["content"] == expected_text(chat_ids(text), n)
            assert held == expected_text(
                chat_ids("hold"), HOLD_TOKENS
            )  # preempted and resumed: the same text
            text = (await client.get("/metrics")).text
            assert metric(text, "tierserve_shed_total", tier="interactive") == 1
            assert metric(text, "tierserve_shed_total", tier="batch") == 1
            assert metric(text, "tierserve_requests_total", tier="interactive", status="429") == 1
            assert metric(text, "tierserve_requests_total", tier="interactive", status="200") == 2
            assert metric(text, "tierserve_queue_time_seconds_count", tier="interactive") == 2
            assert metric(text, "tierserve_admission_seats_in_use") == 0

    asyncio.run(main())


def test_past_the_request_timeout_504_or_an_error_event(server: Server) -> None:
    long = body("forever", 3000)  # 15 s of mock steps, past the 4 s timeout
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        response = client.post("/v1/chat/completions", json=long)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "timeout"
        with client.stream("POST", "/v1/chat/completions", json={**long, "stream": True}) as streamed:
            assert streamed.status_code == 200
            lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and '"code":"timeout"' in lines[-2]
        # Both were aborted on the worker, not left running there.
        assert wait_until(lambda: workers_idle(server.base_url), 1.5)
        text = client.get("/metrics").text
        assert metric(text, "tierserve_requests_total", tier="standard", status="504") == 2
        assert metric(text, "tierserve_admission_seats_in_use") == 0
