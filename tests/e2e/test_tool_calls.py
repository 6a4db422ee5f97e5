"""Tool calling end to end: a real ``tierserve serve`` of the embedded model, the official openai
client. ``tool_choice="required"`` and a named function return calls whose arguments validate against
the tool's schema (Pydantic), streamed (``delta.tool_calls``) and not, with ``finish_reason:
"tool_calls"``; a two-turn loop (call → tool result → answer) works streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, Field

from loadtest.launch import running_server
from worker.models.store import DEFAULT_MODEL, default_model_dir, is_pulled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not is_pulled(default_model_dir()), reason="run `tierserve models pull`"),
]


class WeatherArgs(BaseModel):
    city: str = Field(max_length=24)
    days: int = Field(ge=1, le=14)


class TimeArgs(BaseModel):
    timezone: str = Field(max_length=32)


TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city",
            "parameters": WeatherArgs.model_json_schema(),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now in a timezone",
            "parameters": TimeArgs.model_json_schema(),
        },
    },
]
ASK: list[Any] = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log_path = tmp_path_factory.mktemp("tools") / "serve.log"
    with (
        running_server([], log_path, ready_timeout_s=300) as server,
        openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", timeout=300, max_retries=0
        ) as client,
    ):
        yield client


def one_required_call(client: openai.OpenAI) -> ChatCompletion:
    return client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )


def test_a_required_call_has_arguments_that_validate_against_its_schema(client: openai.OpenAI) -> None:
    completion = one_required_call(client)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and choice.message.content is None
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        ARGS[call.function.name].model_validate_json(call.function.arguments)


def test_a_named_call_streams_as_delta_tool_calls(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=96,
        temperature=0,
        stream=True,
    )
    calls: dict[int, Any] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                calls[delta.index] = delta
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"] and list(calls) == [0]
    assert calls[0].function.name == "get_time" and calls[0].id.startswith("call_")
    TimeArgs.model_validate_json(calls[0].function.arguments)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cut_by", ["max_tokens", "stop"])
def test_a_named_call_cut_short_is_a_call_not_markup(
    client: openai.OpenAI, stream: bool, cut_by: str
) -> None:
    """As OpenAI answers: the call with its arguments as far as they were written, finish "length"
    (max_tokens) or "stop" (a stop string): never "tool_calls", which says the calls are whole."""
    ask: dict[str, Any] = dict(
        model=DEFAULT_MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
    )
    (full,) = client.chat.completions.create(**ask, max_tokens=96).choices[0].message.tool_calls or []
    if cut_by == "max_tokens":
        cut: dict[str, Any] = dict(max_tokens=22)  # of ~35 tokens: to about the arguments' middle
    else:  # a stop string met inside the arguments: the first string value's text
        value = next(v for v in json.loads(full.function.arguments).values() if isinstance(v, str))
        cut = dict(max_tokens=96, stop=[value])
    if stream:
        chunks = list(client.chat.completions.create(**ask, **cut, stream=True))
        content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
        calls: list[Any] = [d for ch in chunks for c in ch.choices for d in c.delta.tool_calls or []]
        reasons = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason is not None]
    else:
        choice = client.chat.completions.create(**ask, **cut).choices[0]
        content, calls, reasons = (
            choice.message.content or "",
            choice.message.tool_calls or [],
            [choice.finish_reason],
        )
    assert reasons == ["length" if cut_by == "max_tokens" else "stop"] and content == ""
    (call,) = calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments and full.function.arguments.startswith(call.function.arguments)
    assert call.function.arguments != full.function.arguments


@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_loop_call_then_result_then_answer(client: openai.OpenAI, stream: bool) -> None:
    first = one_required_call(client)
    message = first.choices[0].message
    assert message.tool_calls, message
    history: list[Any] = [
        *ASK,
        message.model_dump(exclude_none=True),
        *(
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny, 21 C"})}
            for call in message.tool_calls
        ),
    ]
    params: dict[str, Any] = dict(
        model=DEFAULT_MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=48, temperature=0
    )
    if not stream:
        answer = client.chat.completions.create(**params)
        text, reason = answer.choices[0].message.content, answer.choices[0].finish_reason
        assert answer.choices[0].message.tool_calls is None
        alone = client.chat.completions.create(**{**params, "messages": ASK, "max_tokens": 1})
        assert answer.usage is not None and alone.usage is not None
        # The call and its result went into the prompt (tool_choice none: the tools did not).
        assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20
    else:
        pieces, reasons = [], []
        for chunk in client.chat.completions.create(**params, stream=True):
            for choice in chunk.choices:
                assert not choice.delta.tool_calls
                pieces.append(choice.delta.content or "")
                if choice.finish_reason is not None:
                    reasons.append(choice.finish_reason)
        text, reason = "".join(pieces), reasons[-1]
    assert text and text.strip() and reason in ("stop", "length"), (text, reason)


def test_auto_answers_with_text_or_calls_that_parse(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, max_tokens=96, temperature=0
    )
    choice = completion.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name in ARGS and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_tokenize_with_tools_counts_the_prompt_the_chat_endpoint_runs(client: openai.OpenAI) -> None:
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    counted = httpx.post(f"{root}/tokenize", json={"model": DEFAULT_MODEL, "messages": ASK, "tools": TOOLS})
    assert counted.status_code == 200, counted.text
    ran = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
    assert ran.usage is not None and counted.json()["count"] == ran.usage.prompt_tokens
    refused = httpx.post(f"{root}/tokenize", json={"model": DEFAULT_MODEL, "prompt": "hi", "tools": TOOLS})
    assert refused.status_code == 400 and "tools" in refused.text
