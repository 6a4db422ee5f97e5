"""Everything a client can get wrong gets its documented 4xx (never a 5xx), with a well-formed stream
running beside the bad requests the whole time and finishing unchanged.

One real ``tierserve serve --mock 1`` with API keys configured (a keyless anonymous tenant plus a keyed
tenant capped at the ``standard`` tier), driven with raw httpx so malformed bytes reach the server as
they are.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.launch import Server, running_server
from tests.e2e.mock_helpers import chat_ids, expected_text

pytestmark = pytest.mark.timeout(120)

CONFIG = """
[[tenants]]
name = "anonymous"

[[tenants]]
name = "acme"
api_keys = ["acme-key"]
max_tier = "standard"
"""
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MSG = [{"role": "user", "content": "hi"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def tool(name: str, parameters: object = None) -> dict[str, object]:
    function: dict[str, object] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


BESIDE_PROMPT = "a stream that must not notice"
BESIDE_TOKENS = 400  # ~2 s of mock steps: it runs through the whole table


def chat(**fields: object) -> dict[str, object]:
    return {"model": "mock", "messages": MSG, **fields}


def completion(**fields: object) -> dict[str, object]:
    return {"model": "mock", **fields}


def response(**fields: object) -> dict[str, object]:
    return {"model": "mock", "input": "hi", **fields}


INVALID_UTF8 = b'{"model": "mock", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
LONE_SURROGATE = b'{"model": "mock", "messages": [{"role": "user", "content": "\\ud800"}]}'
ACME = {"authorization": "Bearer acme-key"}

SCHEMA_PARAM = "response_format.json_schema.schema"


def schema_format(schema: object) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _deep_schema(depth: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


DEEP_SCHEMA = _deep_schema(100)  # past the grammar engine's nesting limit
# nested inside function_call: a field the body decodes as any JSON (refused only after decoding)
DEEP_BODY = b'{"model": "mock", "messages": [], "function_call": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

# (id, path, body (bytes: sent as is), extra headers, status, error.param)
BAD_REQUESTS: list[tuple[str, str, bytes | dict[str, object], dict[str, str], int, str | None]] = [
    ("malformed json", CHAT, b'{"model": "mock", "messages": [', {}, 400, "body"),
    ("not an object", CHAT, b"[1, 2]", {}, 400, "body"),
    ("a json string", CHAT, b'"hello"', {}, 400, "body"),
    ("empty body", CHAT, b"", {}, 400, "body"),
    ("invalid utf-8", CHAT, INVALID_UTF8, {}, 400, "body"),
    ("lone surrogate", CHAT, LONE_SURROGATE, {}, 400, "body"),
    ("missing model", CHAT, {"messages": MSG}, {}, 400, "model"),
    ("wrong type", CHAT, chat(temperature="hot"), {}, 400, "temperature"),
    ("float max_tokens", CHAT, chat(max_tokens=1.5), {}, 400, "max_tokens"),
    ("huge n", CHAT, chat(n=1000), {}, 400, "n"),
    ("n zero", CHAT, chat(n=0), {}, 400, "n"),
    ("negative temperature", CHAT, chat(temperature=-1), {}, 400, "temperature"),
    ("top_p zero", CHAT, chat(top_p=0), {}, 400, "top_p"),
    ("max_tokens zero", CHAT, chat(max_tokens=0), {}, 400, "max_tokens"),
    ("max_tokens past context", CHAT, chat(max_tokens=5000), {}, 400, "max_tokens"),
    ("huge max_tokens", CHAT, chat(max_tokens=10**15), {}, 400, "max_tokens"),
    ("negative seed", CHAT, chat(seed=-1), {}, 400, "seed"),
    ("penalty range", CHAT, chat(presence_penalty=3), {}, 400, "presence_penalty"),
    ("stop wrong type", CHAT, chat(stop=5), {}, 400, "stop"),
    ("empty stop string", CHAT, chat(stop=[""]), {}, 400, "stop"),
    ("too many stop strings", CHAT, chat(stop=[str(i) for i in range(17)]), {}, 400, "stop"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), {}, 400, "top_logprobs"),
    ("top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=21), {}, 400, "logprobs"),
    ("no messages", CHAT, {"model": "mock", "messages": []}, {}, 400, "messages"),
    ("message without role", CHAT, {"model": "mock", "messages": [{"content": "x"}]}, {}, 400, "messages[0]"),
    (
        "image content",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        {},
        400,
        "messages",
    ),
    ("prompt past context", COMPLETIONS, completion(prompt="x" * 5000), {}, 400, "prompt"),
    ("empty prompt", COMPLETIONS, completion(prompt=""), {}, 400, "prompt"),
    (
        "max_tokens zero without echo",
        COMPLETIONS,
        completion(prompt="hi", max_tokens=0),
        {},
        400,
        "max_tokens",
    ),
    (
        "prompt_logprobs streamed",
        COMPLETIONS,
        completion(prompt="hi", prompt_logprobs=1, stream=True),
        {},
        400,
        "prompt_logprobs",
    ),
    (
        "prompt_logprobs streamed (chat)",
        CHAT,
        chat(prompt_logprobs=0, stream=True),
        {},
        400,
        "prompt_logprobs",
    ),
    ("prompt_logprobs too many", CHAT, chat(prompt_logprobs=21), {}, 400, "prompt_logprobs"),
    ("min_tokens past max_tokens", CHAT, chat(max_tokens=3, min_tokens=4), {}, 400, "min_tokens"),
    (
        "continue_final_message with a generation prompt",
        CHAT,
        chat(continue_final_message=True),
        {},
        400,
        "continue_final_message",
    ),
    (
        "continue_final_message after an empty message",
        CHAT,
        chat(
            messages=[{"role": "assistant", "content": ""}],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        {},
        400,
        "messages[0].content",
    ),
    (
        "chat_template_kwargs setting messages",
        CHAT,
        chat(chat_template_kwargs={"messages": []}),
        {},
        400,
        "chat_template_kwargs.messages",
    ),
    (
        "truncate_prompt_tokens 0",
        COMPLETIONS,
        completion(prompt="hi", truncate_prompt_tokens=0),
        {},
        400,
        "truncate_prompt_tokens",
    ),
    ("negative min_tokens", COMPLETIONS, completion(prompt="hi", min_tokens=-1), {}, 400, "min_tokens"),
    (
        "prompt_logprobs negative",
        COMPLETIONS,
        completion(prompt="hi", prompt_logprobs=-1, echo=True),
        {},
        400,
        "prompt_logprobs",
    ),
    ("empty prompt list", COMPLETIONS, completion(prompt=[]), {}, 400, "prompt"),
    ("mixed prompt list", COMPLETIONS, completion(prompt=["a", 1]), {}, 400, "prompt"),
    ("too many prompts", COMPLETIONS, completion(prompt=["a"] * 65), {}, 400, "prompt"),
    ("token id outside vocabulary", COMPLETIONS, completion(prompt=[5, 10**6]), {}, 400, "prompt"),
    ("logit_bias unknown token", CHAT, chat(logit_bias={"999999999": 100}), {}, 400, "logit_bias"),
    ("logit_bias out of range", CHAT, chat(logit_bias={"1": 1e30}), {}, 400, "logit_bias"),
    ("logit_bias key not a token id", CHAT, chat(logit_bias={"hello": 1}), {}, 400, "logit_bias"),
    ("priority past 32 bits", CHAT, chat(priority=2**40), {}, 400, "priority"),
    ("priority not an integer", COMPLETIONS, completion(priority="high"), {}, 400, "priority"),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), {}, 400, "messages[0].role"),
    (
        "tool message without its call",
        CHAT,
        chat(messages=[*MSG, {"role": "tool", "content": "42"}]),
        {},
        400,
        "messages[1].tool_call_id",
    ),
    (
        "tool message after no call",
        CHAT,
        chat(messages=[*MSG, {"role": "tool", "tool_call_id": "call_1", "content": "42"}]),
        {},
        400,
        "messages[1].tool_call_id",
    ),
    (
        "tool message answering another call",
        CHAT,
        chat(
            messages=[
                *MSG,
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
                {"role": "tool", "tool_call_id": "call_2", "content": "43"},
            ]
        ),
        {},
        400,
        "messages[3].tool_call_id",
    ),
    (
        "tool calls on a user message",
        CHAT,
        chat(messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}]),
        {},
        400,
        "messages[0].tool_calls",
    ),
    (
        "earlier call's arguments not JSON",
        CHAT,
        chat(
            messages=[
                *MSG,
                {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{x"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            ]
        ),
        {},
        400,
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "a call left unanswered before the next turn",
        CHAT,
        chat(
            messages=[
                *MSG,
                {"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
                {"role": "user", "content": "and?"},
            ]
        ),
        {},
        400,
        "messages[1].tool_calls",
    ),
    (
        "the conversation ends on unanswered calls",
        CHAT,
        chat(messages=[*MSG, {"role": "assistant", "tool_calls": [CALL]}]),
        {},
        400,
        "messages[1].tool_calls",
    ),
    (
        "tool of another type",
        CHAT,
        chat(tools=[{"type": "web", "function": {"name": "f"}}]),
        {},
        400,
        "tools[0].type",
    ),
    ("tool name with a space", CHAT, chat(tools=[tool("get weather")]), {}, 400, "tools[0].function.name"),
    ("tool given twice", CHAT, chat(tools=[tool("f"), tool("f")]), {}, 400, "tools[1].function.name"),
    (
        "tool parameters not an object",
        CHAT,
        chat(tools=[tool("f", {"type": "string"})]),
        {},
        400,
        "tools[0].function.parameters",
    ),
    ("tool_choice required without tools", CHAT, chat(tool_choice="required"), {}, 400, "tool_choice"),
    ("tool_choice unknown mode", CHAT, chat(tools=[tool("f")], tool_choice="always"), {}, 400, "tool_choice"),
    (
        "tool_choice names no tool",
        CHAT,
        chat(tools=[tool("f")], tool_choice={"type": "function", "function": {"name": "g"}}),
        {},
        400,
        "tool_choice",
    ),
    (
        "forced call with a response_format",
        CHAT,
        chat(tools=[tool("f")], tool_choice="required", response_format={"type": "json_object"}),
        {},
        400,
        "tool_choice",
    ),
    ("functions (deprecated)", CHAT, chat(functions=[{"name": "f"}]), {}, 400, "functions"),
    (
        "response_format unknown type",
        CHAT,
        chat(response_format={"type": "xml"}),
        {},
        400,
        "response_format.type",
    ),
    ("json_schema without a schema", CHAT, chat(response_format=schema_format(None)), {}, 400, SCHEMA_PARAM),
    (
        "invalid json schema",
        CHAT,
        chat(response_format=schema_format({"type": "wizard"})),
        {},
        400,
        SCHEMA_PARAM,
    ),
    (
        "schema nested 3000 deep",
        CHAT,
        chat(response_format=schema_format(DEEP_SCHEMA)),
        {},
        400,
        SCHEMA_PARAM,
    ),
    ("body nested 100,000 deep", CHAT, DEEP_BODY, {}, 400, "body"),
    ("invalid regex", CHAT, chat(structured_outputs={"regex": "(a+"}), {}, 400, "structured_outputs.regex"),
    (
        "invalid grammar",
        CHAT,
        chat(structured_outputs={"grammar": "start: x"}),
        {},
        400,
        "structured_outputs.grammar",
    ),
    ("empty choice", CHAT, chat(structured_outputs={"choice": []}), {}, 400, "structured_outputs.choice"),
    (
        "two structured kinds",
        CHAT,
        chat(structured_outputs={"regex": "a", "choice": ["b"]}),
        {},
        400,
        "structured_outputs",
    ),
    ("unknown model", CHAT, chat(model="gpt-17"), {}, 404, "model"),
    # The Responses API: the chat path's checks, naming this API's fields.
    ("responses: no input", RESPONSES, {"model": "mock"}, {}, 400, "input"),
    ("responses: past context", RESPONSES, response(max_output_tokens=5000), {}, 400, "max_output_tokens"),
    ("responses: prompt past context", RESPONSES, response(input="x" * 5000), {}, 400, "input"),
    ("responses: chained", RESPONSES, response(previous_response_id="r"), {}, 400, "previous_response_id"),
    ("responses: store", RESPONSES, response(store=True), {}, 400, "store"),
    (
        "responses: image input",
        RESPONSES,
        response(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
        {},
        400,
        "input[0].content[0].type",
    ),
    ("responses: hosted tool", RESPONSES, response(tools=[{"type": "web_search"}]), {}, 400, "tools[0].type"),
    (
        "responses: output for no call",
        RESPONSES,
        response(input=[{"type": "function_call_output", "call_id": "call_9", "output": "42"}]),
        {},
        400,
        "input[0].tool_call_id",
    ),
    (
        "responses: schema past the grammar's nesting",
        RESPONSES,
        response(text={"format": {"type": "json_schema", "name": "x", "schema": DEEP_SCHEMA}}),
        {},
        400,
        "text.format.schema",
    ),
    (
        "responses: top_logprobs too many",
        RESPONSES,
        response(include=["message.output_text.logprobs"], top_logprobs=21),
        {},
        400,
        "top_logprobs",
    ),
    ("responses: unknown model", RESPONSES, response(model="gpt-17"), {}, 404, "model"),
    ("responses: tier above max", RESPONSES, response(service_tier="priority"), ACME, 403, "service_tier"),
    ("responses: unknown field", RESPONSES, response(seed=1), {}, 400, "seed"),
    ("unknown tier", CHAT, chat(), {"x-sla-tier": "platinum"}, 400, "X-SLA-Tier"),
    ("service_tier not served", CHAT, chat(service_tier="scale"), {}, 400, "service_tier"),
    ("service_tier on the legacy API", COMPLETIONS, completion(service_tier="flex"), {}, 400, "service_tier"),
    ("wrong key", CHAT, chat(), {"authorization": "Bearer nope"}, 401, None),
    ("malformed authorization", CHAT, chat(), {"authorization": "Basic Zm9v"}, 401, None),
    (
        "tier above the tenant's",
        CHAT,
        chat(),
        {"authorization": "Bearer acme-key", "x-sla-tier": "interactive"},
        403,
        "X-SLA-Tier",
    ),
    ("oversize body", COMPLETIONS, completion(prompt="x" * (1 << 20)), {}, 413, None),
]


class BesideStream(threading.Thread):
    """A well-formed streamed chat running in the background while the bad requests go in."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.text: list[str] = []
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": "mock", "messages": [{"role": "user", "content": BESIDE_PROMPT}],
                "max_tokens": BESIDE_TOKENS, "temperature": 0, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.base_url}{CHAT}", json=body, timeout=60) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    self.started.set()
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            self.text.append(choice["delta"].get("content") or "")
        except BaseException as exc:
            self.error = exc
        finally:
            self.started.set()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("bad-requests")
    (tmp / "tierserve.toml").write_text(CONFIG)
    args = ["--mock", "1", "--config", str(tmp / "tierserve.toml")]
    with running_server(args, tmp / "serve.log", ready_timeout_s=60) as server:
        yield server


@pytest.fixture(scope="module")
def beside(server: Server) -> Iterator[BesideStream]:
    stream = BesideStream(server.base_url)
    stream.start()
    assert stream.started.wait(30)
    yield stream
    stream.join(60)


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_request_gets_its_4xx(
    server: Server,
    beside: BesideStream,
    path: str,
    body: bytes | dict[str, object],
    headers: dict[str, str],
    status: int,
    param: str | None,
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **headers}
    response = httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=10)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param


def test_at_least_25_kinds_of_bad_request() -> None:
    assert len(BAD_REQUESTS) >= 25


def test_the_stream_beside_them_finished_unchanged(server: Server, beside: BesideStream) -> None:
    beside.join(60)
    assert not beside.is_alive() and beside.error is None
    assert "".join(beside.text) == expected_text(chat_ids(BESIDE_PROMPT), BESIDE_TOKENS)
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'status="500"' not in metrics and 'status="200"' in metrics
