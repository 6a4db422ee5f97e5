"""``tierserve serve`` as a real process when things go wrong: clients that leave, garbage on the
workers' socket, a worker killed mid-stream; and the metrics that count it all. The API surface is in
test_serve.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import zmq
from openai.types.chat import ChatCompletionMessageParam

from loadtest.launch import Server, running_server
from tests.e2e.mock_helpers import TOKENIZER, chat_ids, expected_text, metric, wait_until, workers_idle

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def test_metrics_count_requests_tokens_and_latency(base_url: str, client: openai.OpenAI) -> None:
    before = httpx.get(f"{base_url}/metrics", timeout=5).text
    client.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "count me"}], max_tokens=4
    )
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    assert "# TYPE tierserve_time_to_first_token_seconds histogram" in text
    labels = {"model": "mock", "tier": "standard"}
    done = metric(text, "tierserve_requests_total", status="200", **labels) or 0
    assert done == (metric(before, "tierserve_requests_total", status="200", **labels) or 0) + 1
    tokens = metric(text, "tierserve_output_tokens_total", **labels) or 0
    assert tokens - (metric(before, "tierserve_output_tokens_total", **labels) or 0) == 4
    assert (metric(text, "tierserve_time_to_first_token_seconds_count", **labels) or 0) >= 1
    assert metric(text, "tierserve_worker_up", worker="mock-0", state="ready") == 1
    # The mock worker measured its floor at start (5 ms steps): every default tier is within reach.
    for tier in ("interactive", "standard", "batch"):
        assert metric(text, "tierserve_tier_slo_feasible", model="mock", tier=tier) == 1


def test_non_streamed_client_that_leaves_aborts_its_request(base_url: str) -> None:
    assert wait_until(lambda: workers_idle(base_url), 5)
    body = {"model": "mock", "messages": [{"role": "user", "content": "long"}], "max_tokens": 3000}
    with pytest.raises(httpx.ReadTimeout):  # 3000 mock steps are 15 s; we leave after 0.5 s
        httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=0.5)
    # The worker frees the request's blocks at once; its next heartbeat (every 0.5 s) tells the gateway.
    assert wait_until(lambda: workers_idle(base_url), 1.5)
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    assert (metric(text, "tierserve_requests_total", model="mock", tier="standard", status="499") or 0) >= 1


def test_malformed_frames_to_the_gateway_socket_are_dropped(
    mock_server: tuple[Server, Path], client: openai.OpenAI
) -> None:
    server, log_path = mock_server
    address = re.search(r"worker\(s\) of 'mock' on (tcp://\S+)", log_path.read_text())
    assert address is not None
    before = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    ctx = zmq.Context()
    try:
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 1000)
        rogue.connect(address.group(1))
        rogue.send(b"\x00garbage, not msgpack")
        rogue.send(msgspec.msgpack.encode({"type": "heartbeat", "v": 1, "worker_id": "mock-0"}))  # incomplete
        rogue.send(msgspec.msgpack.encode({"type": "from_the_future", "v": 99}))
        rogue.send_multipart([b"two", b"frames"])
        rogue.close()
    finally:
        ctx.term()

    def dropped(text: str) -> float:
        return sum(metric(text, "tierserve_wire_frames_dropped_total", reason=r) or 0
                   for r in ("malformed", "version", "multipart"))  # fmt: skip

    base = dropped(before)
    assert wait_until(lambda: dropped(httpx.get(f"{server.base_url}/metrics", timeout=5).text) >= base + 4, 5)
    reply = client.completions.create(model="mock", prompt="still serving", max_tokens=5, temperature=0)
    assert reply.choices[0].text == expected_text(TOKENIZER.encode("still serving"), 5)


def test_client_disconnect_mid_stream_leaves_server_healthy(base_url: str, client: openai.OpenAI) -> None:
    body = {"model": "mock", "messages": MSG, "max_tokens": 3000, "stream": True}
    with httpx.Client(timeout=10) as http:
        for _ in range(3):
            with http.stream("POST", f"{base_url}{CHAT}", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                received = [next(lines) for _ in range(6)]
                assert all(line == "" or line.startswith("data: ") for line in received)
            # Leaving the block closes the connection mid-stream.
    completion = client.chat.completions.create(model="mock", messages=MSG, max_tokens=5, temperature=0)
    assert completion.choices[0].message.content == expected_text(chat_ids("hi"), 5)
    assert httpx.get(f"{base_url}/ready", timeout=5).status_code == 200


# ---------------------------------------------------------------- a worker lost mid-stream


@pytest.fixture
def server_one_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("serve-lost") / "serve.log"
    with running_server(["--mock", "1"], log_path, ready_timeout_s=60) as server:
        yield server


def test_worker_killed_mid_stream_ends_with_error_event_then_503(server_one_worker: Server) -> None:
    [worker_pid] = server_one_worker.worker_pids()
    body = {
        "model": "mock",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4000,
        "stream": True,
    }
    events: list[str] = []
    # The read timeout bounds the wait: the gateway declares the worker lost after 3 s of silence.
    with httpx.Client(timeout=httpx.Timeout(30.0)) as http:
        with http.stream("POST", f"{server_one_worker.base_url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line:
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    os.kill(worker_pid, signal.SIGKILL)  # tokens are flowing: the request is in flight
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        # The only worker is gone: there is nowhere to migrate the request to, so the stream ends.
        assert error["code"] == "worker_lost" and "no healthy worker" in error["message"], error
        # No worker left: new requests are refused with 503, and /ready says so.
        after = http.post(f"{server_one_worker.base_url}/v1/chat/completions", json={**body, "stream": False})
        assert after.status_code == 503, after.text
        assert after.json()["error"]["message"]
        assert http.get(f"{server_one_worker.base_url}/ready").status_code == 503


def test_a_port_in_use_fails_before_any_worker_starts() -> None:
    """The HTTP port is bound before the workers start: taken, serve says so and exits 1 at once, no
    model loaded for nothing."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [
            sys.executable,
            "-m",
            "tierserve",
            "serve",
            "--mock",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert f"cannot listen on 127.0.0.1:{port}" in output, output
    assert "starting" not in output, output
