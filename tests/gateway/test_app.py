"""The HTTP front's one completion path: both endpoints refuse what a client got wrong with the same
statuses and messages, before any work is queued; and the models routes (httpx's ASGI transport; a
registry fed Register messages directly, no worker processes)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.app import create_app
from gateway.dispatch import Dispatcher
from gateway.state import Gateway
from gateway.tokenizer import BytePromptBuilder
from tests.wire.registers import cpu_register
from wire.config import GatewayConfig, ServerConfig, Tenant
from wire.messages import Register

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CONTEXT = 128


def register(vocab_size: int) -> Register:
    return cpu_register("mock-0", model="mock", max_model_len=CONTEXT, vocab_size=vocab_size)


def call(
    method: str,
    path: str,
    body: dict[str, object] | None = None,
    *,
    vocab_size: int = 300,
    config: ServerConfig | None = None,
    headers: dict[str, str] | None = None,
    models: tuple[str, ...] = ("mock",),
) -> httpx.Response:
    async def main() -> httpx.Response:
        dispatcher = Dispatcher("tcp://127.0.0.1:0")
        dispatcher.registry.on_register(register(vocab_size), 0.0)
        builders = {name: BytePromptBuilder() for name in models}
        gateway = Gateway(dispatcher, config or ServerConfig(), builders, 1234)
        try:
            transport = httpx.ASGITransport(app=create_app(gateway))
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
                return await http.request(method, path, json=body, headers=headers)
        finally:
            await dispatcher.close()

    return asyncio.run(main())


def post(path: str, body: dict[str, object], *, vocab_size: int = 300) -> httpx.Response:
    return call("POST", path, {"model": "mock", **body}, vocab_size=vocab_size)


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        (CHAT, {"messages": MSG, "model": "gpt-17"}, 404, "model", "model 'gpt-17' is not served here"),
        (COMPLETIONS, {"prompt": "hi", "model": "gpt-17"}, 404, "model", "model 'gpt-17' is not served here"),
        (CHAT, {"messages": MSG, "n": 0}, 400, "n", "n: must be between 1 and 8, got 0"),
        (COMPLETIONS, {"prompt": "hi", "n": 9}, 400, "n", "n: must be between 1 and 8, got 9"),
        (COMPLETIONS, {"prompt": ""}, 400, "prompt", "prompt: must contain at least one token"),
        (COMPLETIONS, {"prompt": ["a", ""]}, 400, "prompt", "prompt: must contain at least one token"),
        (COMPLETIONS, {"prompt": [5, 10**6]}, 400, "prompt",
         "prompt: token ids outside the vocabulary: [1000000]"),
        (COMPLETIONS, {"prompt": "x" * CONTEXT}, 400, "prompt",
         f"prompt: {CONTEXT} tokens leave no room in the model's context of {CONTEXT} tokens"),
        (CHAT, {"messages": [{"role": "user", "content": "x" * CONTEXT}]}, 400, "messages",
         "messages: "),
        (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "top_logprobs: needs logprobs"),
        (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", "max_tokens: must be at least 1"),
        (COMPLETIONS, {"prompt": [[1], "a"]}, 400, "prompt", "prompt: a list must be all strings"),
    ],
)  # fmt: skip
def test_both_endpoints_refuse_a_bad_request_before_any_work(
    path: str, body: dict[str, object], status: int, param: str, message: str
) -> None:
    response = post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_a_chat_prompt_outside_the_workers_vocabulary_names_messages() -> None:
    """Both of the gateway's prompt errors now name the field the client wrote (it used to say "prompt"
    for this one on a chat request)."""
    error = post(CHAT, {"messages": MSG}, vocab_size=50).json()["error"]
    assert error["param"] == "messages"
    assert error["message"].startswith("messages: token ids outside the vocabulary: [")


def test_a_model_is_listed_and_retrieved_by_name_slashes_and_all() -> None:
    models = ("mock", "org/small-model")
    listed = call("GET", "/v1/models", models=models).json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == list(models)
    for name in models:
        card = call("GET", f"/v1/models/{name}", models=models)
        assert card.status_code == 200, card.text
        body = card.json()
        length = body.pop("max_model_len", None)  # vLLM's: there once a worker of it has registered
        assert body == {"id": name, "object": "model", "created": 1234, "owned_by": "tierserve"}
        assert length == (CONTEXT if name == "mock" else None)  # only mock-0 has registered
    missing = call("GET", "/v1/models/gpt-17", models=models)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert error["message"] == "model 'gpt-17' is not served here (served: 'mock', 'org/small-model')"


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/mock"])
def test_the_models_routes_take_the_completion_routes_keys(path: str) -> None:
    keyed = ServerConfig(
        gateway=GatewayConfig(require_api_key=True), tenants=(Tenant(name="chat", api_keys=("k1",)),)
    )
    assert call("GET", path, config=keyed).status_code == 401
    assert call("GET", path, config=keyed, headers={"authorization": "Bearer nope"}).status_code == 401
    assert call("GET", path, config=keyed, headers={"authorization": "Bearer k1"}).status_code == 200
    assert call("GET", path).status_code == 200  # no keys configured: open, as the completion routes
