"""``tierserve serve`` as a real process, driven by the official openai client and raw httpx.

Mock workers (fast) for the API surface; one worker killed mid-stream; the real embedded model (slow)
against the in-process engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.tokenizer import HFPromptBuilder
from wire.sampling import SamplingParams
from worker.mock import MockModel, MockTokenizer
from worker.models.store import DEFAULT_MODEL, default_model_dir, is_pulled

pytestmark = pytest.mark.timeout(120)

TOKENIZER = MockTokenizer()
MODEL = MockModel()


# ---------------------------------------------------------------- the server process

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Server:
    url: str
    process: subprocess.Popen[bytes]

    def worker_pids(self) -> list[int]:
        """The worker processes serve started (its direct children; Linux /proc)."""
        pid = self.process.pid
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@contextmanager
def running_server(args: list[str], log_path: Path, ready_timeout_s: float) -> Iterator[Server]:
    """Yield the server once ``/ready`` answers 200; the whole process group is killed afterwards."""
    port = free_port()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tierserve", "serve", "--port", str(port), *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: teardown reaches the workers too
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, base_url, ready_timeout_s, log_path)
        yield Server(base_url, process)
    finally:
        _stop(process)


def _wait_ready(process: subprocess.Popen[bytes], base_url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"serve exited with {process.returncode}:\n{log_path.read_text()}")
            try:
                if client.get(f"{base_url}/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.1)  # polling interval of a deadline-bounded wait, not synchronisation
    raise TimeoutError(f"{base_url}/ready not 200 after {timeout_s} s:\n{log_path.read_text()}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=20)
    # Whatever is left of the group (a worker that ignored SIGTERM, or serve itself) dies now.
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


# ---------------------------------------------------------------- mock workers


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(["--mock", "2"], log_path, ready_timeout_s=60) as server:
        yield server.url


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=30, max_retries=0) as c:
        yield c


def expected_text(prompt_ids: list[int], max_tokens: int) -> str:
    return TOKENIZER.decode(MODEL.transcript(prompt_ids, max_tokens), skip_special_tokens=True)


def chat_ids(text: str) -> list[int]:
    ids = TOKENIZER.apply_chat_template([{"role": "user", "content": text}])
    assert isinstance(ids, list)
    return ids


def test_health_ready_models(base_url: str, client: openai.OpenAI) -> None:
    assert httpx.get(f"{base_url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{base_url}/ready", timeout=5).status_code == 200
    assert [m.id for m in client.models.list()] == ["mock"]


def test_chat_non_stream(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="mock", messages=[{"role": "user", "content": "Hello there"}], max_tokens=20, temperature=0
    )
    assert raw.headers["x-sla-tier"] == "standard"
    assert raw.headers["x-tierserve-model"] == "mock"
    completion = raw.parse()
    ids = chat_ids("Hello there")
    assert completion.choices[0].message.content == expected_text(ids, 20)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(ids), 20)
    assert completion.usage.total_tokens == len(ids) + 20


def test_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="mock",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "東京 ✓"}],
        max_completion_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = TOKENIZER.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "東京 ✓"}]
    )
    assert isinstance(ids, list)
    assert text == expected_text(ids, 30)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 30)


def test_completions_non_stream_and_stream(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    ids = TOKENIZER.encode(prompt)
    whole = client.completions.create(model="mock", prompt=prompt, max_tokens=25, temperature=0)
    assert whole.choices[0].text == expected_text(ids, 25)
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 25)
    chunks = list(
        client.completions.create(
            model="mock",
            prompt=prompt,
            max_tokens=25,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text(ids, 25)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 25


def test_stop_string_ends_the_text(client: openai.OpenAI) -> None:
    ids = chat_ids("stop test")
    full = expected_text(ids, 40)
    stop = full[10:12]
    completion = client.chat.completions.create(
        model="mock",
        messages=[{"role": "user", "content": "stop test"}],
        max_tokens=40,
        temperature=0,
        stop=stop,
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == full[: full.index(stop)]


def test_sixteen_concurrent_streams(base_url: str) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        prompt = f"request number {i}"
        stream = await client.chat.completions.create(
            model="mock",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=32,
            temperature=0,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return text, expected_text(chat_ids(prompt), 32)

    async def main() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key="unused", timeout=60, max_retries=0
        ) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(16))), timeout=90)

    results = asyncio.run(main())
    assert len(results) == 16
    for got, expected in results:
        assert got == expected


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
OK = {"model": "mock", "messages": MSG}

BAD_REQUESTS = [
    ("malformed json", CHAT, b'{"model": "mock", "messages": [', 400, "body"),
    ("not an object", CHAT, b"[1, 2]", 400, "body"),
    ("missing model", CHAT, {"messages": MSG}, 400, "model"),
    ("wrong type", CHAT, {"model": "mock", "messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("n too big", CHAT, {"model": "mock", "messages": MSG, "n": 1000}, 400, "n"),
    ("n > 1 unsupported", CHAT, {"model": "mock", "messages": MSG, "n": 2}, 400, "n"),
    ("negative temperature", CHAT, {"model": "mock", "messages": MSG, "temperature": -1}, 400, "temperature"),
    ("top_p zero", CHAT, {"model": "mock", "messages": MSG, "top_p": 0}, 400, "top_p"),
    ("max_tokens zero", CHAT, {"model": "mock", "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (
        "max_tokens past context",
        CHAT,
        {"model": "mock", "messages": MSG, "max_tokens": 5000},
        400,
        "max_tokens",
    ),
    ("prompt past context", COMPLETIONS, {"model": "mock", "prompt": "x" * 5000}, 400, "prompt"),
    ("unknown model", CHAT, {"model": "gpt-17", "messages": MSG}, 404, "model"),
    ("stop wrong type", CHAT, {"model": "mock", "messages": MSG, "stop": 5}, 400, "stop"),
    ("empty stop string", CHAT, {"model": "mock", "messages": MSG, "stop": [""]}, 400, "stop"),
    ("empty prompt", COMPLETIONS, {"model": "mock", "prompt": ""}, 400, "prompt"),
    ("no messages", CHAT, {"model": "mock", "messages": []}, 400, "messages"),
    ("bad message", CHAT, {"model": "mock", "messages": [{"content": "x"}]}, 400, "messages[0]"),
    ("logprobs not yet", CHAT, {"model": "mock", "messages": MSG, "logprobs": True}, 400, "logprobs"),
    (
        "penalty range",
        CHAT,
        {"model": "mock", "messages": MSG, "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    ("oversize body", COMPLETIONS, {"model": "mock", "prompt": "x" * (1 << 20)}, 413, None),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_request_gets_openai_error(
    base_url: str, path: str, body: bytes | dict[str, object], status: int, param: str | None
) -> None:
    kwargs: dict[str, object] = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{base_url}{path}", timeout=10, **kwargs)  # type: ignore[arg-type]
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param


def test_unknown_fields_are_ignored(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="mock", messages=MSG, max_tokens=3, extra_body={"some_future_field": {"x": 1}}
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 3


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="mock", messages=MSG, temperature=-2)
    assert "temperature" in str(info.value)


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


def test_wrong_method_and_path_are_json_errors(base_url: str) -> None:
    for response in (
        httpx.get(f"{base_url}{CHAT}", timeout=5),
        httpx.get(f"{base_url}/v2/nothing", timeout=5),
    ):
        assert response.status_code in (404, 405)
        assert response.json()["error"]["message"]


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
        with http.stream("POST", f"{server_one_worker.url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line:
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    os.kill(worker_pid, signal.SIGKILL)  # tokens are flowing: the request is in flight
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "worker_lost" and error["message"]
        # No worker left: new requests are refused with 503, and /ready says so.
        after = http.post(f"{server_one_worker.url}/v1/chat/completions", json={**body, "stream": False})
        assert after.status_code == 503, after.text
        assert after.json()["error"]["message"]
        assert http.get(f"{server_one_worker.url}/ready").status_code == 503


# ---------------------------------------------------------------- the real embedded model (slow)

needs_model = pytest.mark.skipif(not is_pulled(default_model_dir()), reason="run `tierserve models pull`")
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("serve-model") / "serve.log"
    with running_server([], log_path, ready_timeout_s=300) as server:
        yield server.url


def engine_text() -> str:
    from worker.config import EngineConfig
    from worker.engine import Engine

    engine = Engine.from_config(EngineConfig(model="default"))
    prompt_ids = HFPromptBuilder(default_model_dir()).chat_ids(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    request_id = engine.add_request(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    text: list[str] = []
    while engine.has_unfinished():
        text += [out.text_delta for out in engine.step() if out.request_id == request_id]
    return "".join(text)


@pytest.mark.slow
@pytest.mark.timeout(600)
@needs_model
def test_chat_matches_in_process_engine(model_url: str) -> None:
    with openai.OpenAI(base_url=f"{model_url}/v1", api_key="unused", timeout=300, max_retries=0) as client:
        completion = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
        )
    text = completion.choices[0].message.content
    assert text, "the model answered nothing"
    assert text == engine_text()
