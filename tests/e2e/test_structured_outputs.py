"""Structured outputs end to end: a real ``tierserve serve`` of the embedded model, the official openai
client. ``chat.completions.parse`` with a Pydantic model returns the parsed object; vLLM's
``structured_outputs`` (choice, regex) through ``extra_body``, streamed and not; constrained and plain
requests at once; grammar abuse is a 400 naming the field within a bounded time."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from loadtest.launch import running_server
from worker.models.store import DEFAULT_MODEL, default_model_dir, is_pulled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not is_pulled(default_model_dir()), reason="run `tierserve models pull`"),
]
MESSAGES = [{"role": "user", "content": "Ada is a 36 year old engineer. Give her name and age as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("structured") / "serve.log"
    with running_server([], log_path, ready_timeout_s=300) as server:
        yield server.base_url


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300, max_retries=0) as client:
        yield client


def test_parse_with_a_pydantic_model_returns_the_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=DEFAULT_MODEL, messages=MESSAGES, response_format=Person, max_tokens=64, temperature=0
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Person)


def test_json_object_and_vllm_choice_and_regex_streamed_and_not(client: openai.OpenAI) -> None:
    obj = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=64,
        temperature=0,
    )
    content = obj.choices[0].message.content
    assert content is not None and obj.choices[0].finish_reason == "stop", content
    assert isinstance(json.loads(content), dict)
    choices = ["positive", "negative", "neutral"]
    choice = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "Classify: tierserve is wonderful!"}],
        extra_body={"structured_outputs": {"choice": choices}},
        temperature=0,
    )
    assert choice.choices[0].message.content in choices
    stream = client.completions.create(
        model=DEFAULT_MODEL,
        prompt="The order number is",
        extra_body={"structured_outputs": {"regex": r" [0-9]{4}-[A-Z]{3}"}},
        max_tokens=16,
        temperature=0.7,
        seed=5,
        stream=True,
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert re.fullmatch(r" [0-9]{4}-[A-Z]{3}", text), text


def test_constrained_and_plain_requests_at_once(base_url: str) -> None:
    async def run() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300) as client:

            async def one(i: int) -> str | None:
                extra = {"structured_outputs": {"choice": ["red", "green"]}} if i % 2 else {}
                completion = await client.chat.completions.create(
                    model=DEFAULT_MODEL,
                    messages=[{"role": "user", "content": f"Pick a colour, request {i}."}],
                    max_tokens=12,
                    temperature=0,
                    extra_body=extra,
                )
                return completion.choices[0].message.content

            return await asyncio.gather(*(one(i) for i in range(8)))

    answers = asyncio.run(run())
    assert all(answers[i] in ("red", "green") for i in range(1, 8, 2))
    assert all(answers[i] for i in range(0, 8, 2))


def deep_schema(depth: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def schema_format(schema: dict[str, object]) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": schema_format({"type": "wizard"})}, "response_format.json_schema.schema"),
        ({"response_format": schema_format(deep_schema(100))}, "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "(a+"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ],
)  # fmt: skip
def test_grammar_abuse_is_a_400_naming_the_field_fast(
    base_url: str, fields: dict[str, object], param: str
) -> None:
    body = {"model": DEFAULT_MODEL, "messages": MESSAGES, "max_tokens": 8, **fields}
    start = time.monotonic()
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert time.monotonic() - start < 5.0


def test_a_pathological_regex_is_served_not_stalled(client: openai.OpenAI) -> None:
    start = time.monotonic()
    completion = client.completions.create(
        model=DEFAULT_MODEL,
        prompt="Say a:",
        extra_body={"structured_outputs": {"regex": "(a+)+$"}},
        max_tokens=8,
        temperature=0,
    )
    assert re.fullmatch("a+", completion.choices[0].text)
    assert time.monotonic() - start < 60
