"""The Responses API end to end: a real ``tierserve serve`` of the embedded model, the official openai
client's ``responses`` resource. Greedy answers are the chat endpoint's, token for token (the same
messages through the same template); a stream's events add up to its final response; a required tool
call parses against its schema and a two-turn loop (call → output → answer) runs streamed and not;
``responses.parse`` returns the Pydantic object its schema asked for."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from loadtest.launch import running_server
from tests.e2e.test_tool_calls import WeatherArgs
from worker.models.store import DEFAULT_MODEL, default_model_dir, is_pulled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not is_pulled(default_model_dir()), reason="run `tierserve models pull`"),
]


class Color(BaseModel):
    name: str = Field(max_length=16)
    hex: str = Field(pattern="^#[0-9a-f]{6}$")


WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast for a city",
    "parameters": WeatherArgs.model_json_schema(),
}
ASK = "What will the weather be in Paris for the next 3 days?"
INSTRUCTIONS = "You answer in one short sentence."


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log_path = tmp_path_factory.mktemp("responses") / "serve.log"
    with (
        running_server([], log_path, ready_timeout_s=300) as server,
        openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", timeout=300, max_retries=0
        ) as client,
    ):
        yield client


def test_a_greedy_response_is_the_chat_endpoint_s_answer(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=DEFAULT_MODEL,
        instructions=INSTRUCTIONS,
        input="Name a color.",
        max_output_tokens=12,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name a color."}],
        max_tokens=12,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    finished = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finished == "length" else "completed")
    assert response.id.startswith("resp_") and response.model == DEFAULT_MODEL and response.store is False


def test_a_stream_adds_up_to_its_final_response(client: openai.OpenAI) -> None:
    kwargs: Any = {
        "model": DEFAULT_MODEL,
        "input": "Count to five.",
        "max_output_tokens": 16,
        "temperature": 0,
    }
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_required_call_then_its_output_then_an_answer(client: openai.OpenAI) -> None:
    ask: Any = {
        "model": DEFAULT_MODEL,
        "input": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 96,
        "temperature": 0,
    }
    first = client.responses.create(**ask)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and first.status == "completed"
    WeatherArgs.model_validate_json(call.arguments)  # the grammar held the arguments to the schema
    with client.responses.stream(**ask) as stream:  # the SDK's helper, which wants response.completed
        streamed_call = [item for item in stream.get_final_response().output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed_call] == [(call.name, call.arguments)]
    history: list[Any] = [
        {"role": "user", "content": ASK},
        *(item.model_dump(exclude_none=True) for item in first.output),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny, 21 C"}'},
    ]
    answer = client.responses.create(
        model=DEFAULT_MODEL, input=history, tools=[WEATHER], max_output_tokens=32, temperature=0
    )
    assert answer.output and answer.output[0].type == "message" and answer.output_text
    streamed = list(
        client.responses.create(
            model=DEFAULT_MODEL,
            input=history,
            tools=[WEATHER],
            max_output_tokens=32,
            temperature=0,
            stream=True,
        )
    )
    final = streamed[-1].response
    assert final.output_text == answer.output_text
    assert [item.type for item in final.output] == [item.type for item in answer.output]


def test_parse_returns_the_object_its_schema_asked_for(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=DEFAULT_MODEL,
        input="Give a color as JSON with its name and hex code.",
        text_format=Color,
        max_output_tokens=64,
        temperature=0,
    )
    assert isinstance(parsed.output_parsed, Color)


def test_what_is_not_served_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=DEFAULT_MODEL, input="hi", previous_response_id="resp_1")
    assert info.value.body is not None and info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=DEFAULT_MODEL, input="hi", max_output_tokens=10**6)
    assert info.value.body["param"] == "max_output_tokens"  # type: ignore[index]
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError, match="not stored here"):
            call("resp_1")
