"""``tierserve serve --config`` with two keyed tenants: identity and tier statuses, then a SIGTERM drain
under live streams (each test that drains owns its server, since the drain ends it)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest

from loadtest.launch import Server, running_server
from tests.e2e.mock_helpers import chat_ids, expected_text, wait_until

pytestmark = pytest.mark.timeout(120)

CONFIG = """
[gateway]
drain_timeout_s = 60.0

[[tenants]]
name = "chat"
api_keys = ["chat-key"]
default_tier = "interactive"

[[tenants]]
name = "jobs"
api_keys = ["jobs-key"]
default_tier = "batch"
max_tier = "standard"
"""
MSG = [{"role": "user", "content": "Hello"}]
ServiceTier = Literal["auto", "default", "flex", "priority"]
NUM_STREAMS = 5
# At the mock's 5 ms per step this is seconds of streaming: far more than the SIGTERM → 503 round trip
# needs, so the 503 is always seen while the streams still run.
STREAM_TOKENS = 600
DEADLINE_S = 30.0


def start(tmp_path: Path) -> Iterator[Server]:
    config = tmp_path / "tierserve.toml"
    config.write_text(CONFIG)
    with running_server(["--mock", "2", "--config", str(config)], tmp_path / "serve.log", 60) as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from start(tmp_path_factory.mktemp("tiers"))


@pytest.fixture
def draining_server(tmp_path: Path) -> Iterator[Server]:
    yield from start(tmp_path)


def chat(url: str, key: str | None, tier: str | None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    if tier is not None:
        headers["X-SLA-Tier"] = tier
    body = {"model": "mock", "messages": MSG, "max_tokens": 3}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=10)


@pytest.mark.parametrize(
    ("key", "tier", "echoed"),
    [("chat-key", None, "interactive"), ("chat-key", "batch", "batch"), ("jobs-key", "standard", "standard")],
)
def test_allowed_tier_is_served_and_echoed(server: Server, key: str, tier: str | None, echoed: str) -> None:
    response = chat(server.base_url, key, tier)
    assert response.status_code == 200, response.text
    assert response.headers["x-sla-tier"] == echoed
    assert response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("key", "tier", "status", "kind"),
    [
        (None, None, 401, "authentication_error"),
        ("wrong-key", None, 401, "authentication_error"),
        ("jobs-key", "interactive", 403, "permission_error"),
        ("chat-key", "gold", 400, "invalid_request_error"),
    ],
    ids=["no key", "wrong key", "above max tier", "unknown tier"],
)
def test_refused(server: Server, key: str | None, tier: str | None, status: int, kind: str) -> None:
    response = chat(server.base_url, key, tier)
    assert response.status_code == status, response.text
    assert response.json()["error"]["type"] == kind
    if status in (400, 403):
        assert response.json()["error"]["param"] == "X-SLA-Tier"


@pytest.mark.parametrize(
    ("key", "header", "service_tier", "tier", "named"),
    [
        ("chat-key", None, "flex", "batch", "flex"),
        ("chat-key", None, "auto", "interactive", "priority"),  # the tenant's default, named back
        ("jobs-key", None, "default", "standard", "default"),
        ("jobs-key", "batch", "flex", "batch", "flex"),  # the header's tier again
    ],
)
def test_openais_service_tier_picks_the_tier_and_the_answer_names_it(
    server: Server, key: str, header: str | None, service_tier: ServiceTier, tier: str, named: str
) -> None:
    headers = {} if header is None else {"X-SLA-Tier": header}
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=10) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="mock", messages=MSG, max_tokens=3, service_tier=service_tier, extra_headers=headers
        )
        assert raw.headers["x-sla-tier"] == tier
        assert raw.parse().service_tier == named
        stream = client.chat.completions.create(
            model="mock",
            messages=MSG,
            max_tokens=3,
            service_tier=service_tier,
            extra_headers=headers,
            stream=True,
        )
        assert {chunk.service_tier for chunk in stream} == {named}


@pytest.mark.parametrize(
    ("key", "header", "service_tier", "status", "kind"),
    [
        ("jobs-key", None, "priority", 403, "permission_error"),  # above its max_tier
        ("chat-key", "batch", "priority", 400, "invalid_request_error"),  # the header says another
        ("chat-key", None, "scale", 400, "invalid_request_error"),  # not mapped here
    ],
    ids=["above max tier", "conflicts with the header", "not served"],
)
def test_a_service_tier_refused_names_it(
    server: Server, key: str, header: str | None, service_tier: str, status: int, kind: str
) -> None:
    headers = {"Authorization": f"Bearer {key}"} | ({} if header is None else {"X-SLA-Tier": header})
    body = {"model": "mock", "messages": MSG, "max_tokens": 3, "service_tier": service_tier}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=10)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == (kind, "service_tier")


def test_sigterm_drains_live_streams_then_exits_0(draining_server: Server, tmp_path: Path) -> None:
    server = draining_server
    worker_pids = server.worker_pids()
    assert len(worker_pids) == 2
    auth = {"Authorization": "Bearer chat-key"}
    # Greedy, so each stream is the mock's known 600-token transcript (no early EOS).
    body = {"model": "mock", "messages": MSG, "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True}

    async def one_stream(client: httpx.AsyncClient, started: asyncio.Event) -> list[dict[str, object]]:
        chunks: list[dict[str, object]] = []
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=auth) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return chunks
                chunks.append(json.loads(line[len("data: ") :]))
                started.set()
        raise AssertionError("stream ended without [DONE]")

    async def main() -> tuple[list[list[dict[str, object]]], httpx.Response, list[bool]]:
        async with (
            asyncio.timeout(DEADLINE_S),
            httpx.AsyncClient(base_url=server.base_url, timeout=30) as client,
        ):
            started = [asyncio.Event() for _ in range(NUM_STREAMS)]
            streams = [asyncio.create_task(one_stream(client, e)) for e in started]
            for event in started:
                await event.wait()  # every stream is in flight before the signal
            os.kill(server.process.pid, signal.SIGTERM)
            # New connections (a separate client), as a load balancer's probes and new callers would be.
            async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as fresh:
                while (await fresh.get("/ready")).status_code != 503:
                    await asyncio.sleep(0.01)  # poll interval under the deadline, not synchronisation
                refused = await fresh.post("/v1/chat/completions", json=body, headers=auth)
            running_at_refusal = [not s.done() for s in streams]
            return await asyncio.gather(*streams), refused, running_at_refusal

    results, refused, running_at_refusal = asyncio.run(main())

    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert refused.json()["error"]["code"] == "draining"
    assert all(running_at_refusal)
    whole = expected_text(chat_ids("Hello"), STREAM_TOKENS)
    for chunks in results:
        assert not any("error" in c for c in chunks)
        choices = [c["choices"][0] for c in chunks]  # type: ignore[index]
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
        assert "".join(c["delta"].get("content") or "" for c in choices) == whole  # nothing cut short
    assert server.process.wait(timeout=DEADLINE_S) == 0
    for pid in worker_pids:  # serve reaps its workers before it exits, so none may be left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # ...and stops them before it closes their link: a clean stop logs no lost connection
    log = (tmp_path / "serve.log").read_text()
    assert "stopped" in log and "lost its connection" not in log, log[-3000:]


@pytest.mark.parametrize("twice", [False, True], ids=["ctrl-c", "sigterm-twice"])
def test_a_stop_without_drain_ends_live_streams_at_once(
    draining_server: Server, tmp_path: Path, twice: bool
) -> None:
    """Ctrl-C, or a second SIGTERM while draining, does not wait for running streams: each ends with an
    error event and [DONE] long before its tokens would have, and serve exits 0 with a clean log."""
    server = draining_server
    auth = {"Authorization": "Bearer chat-key"}
    body = {"model": "mock", "messages": MSG, "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True}
    events: list[str] = []

    def stop() -> None:
        if not twice:
            os.kill(server.process.pid, signal.SIGINT)
            return
        os.kill(server.process.pid, signal.SIGTERM)
        # the drain has begun (two signals sent at once may reach the process as one)
        assert wait_until(lambda: httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 503, 10)
        os.kill(server.process.pid, signal.SIGTERM)

    with (
        httpx.Client(base_url=server.base_url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    stop()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "unavailable" and "stopping" in error["message"], error
    assert len(events) < STREAM_TOKENS  # ended, not streamed to the end
    assert server.process.wait(timeout=DEADLINE_S) == 0
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "lost its connection" not in log, log[-3000:]
