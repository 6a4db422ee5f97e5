"""The Responses API at the gateway: a body read as the chat request it stands for, errors naming this
API's fields, and answers (whole and streamed) that the openai client's own types accept."""

from __future__ import annotations

from typing import Any

import msgspec
import pydantic
import pytest
from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseStreamEvent

from gateway.errors import APIError, invalid
from gateway.logprobs import TokenTexts
from gateway.openai_api import ChoiceResult
from gateway.openai_types import UsageInfo
from gateway.responses_api import ResponsesRenderer
from gateway.responses_requests import ResponsesChat, decode_responses, responses_field
from wire.errors import InvalidRequestError
from wire.messages import TokenDelta, TokenLogprob, Usage

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
PING = {"type": "function", "name": "ping", "parameters": {"type": "object", "properties": {}}}
CALL = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
USAGE_SO_FAR = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
USAGE = UsageInfo.total([USAGE_SO_FAR], [0])


def body(**fields: object) -> bytes:
    return msgspec.json.encode({"model": "m", "input": "hi", **fields})


def decoded(**fields: object) -> ResponsesChat:
    return decode_responses(body(**fields))


def test_instructions_and_text_input_become_a_system_and_a_user_message() -> None:
    chat = decoded(instructions="Be brief.", max_output_tokens=9, temperature=0.2, top_p=0.5, stream=True)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "hi")]
    sampling = chat.to_sampling(room=100)
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (9, 0.2, 0.5)
    assert chat.stream and chat.n == 1 and chat.logprobs is False
    assert chat.origin is not None and chat.origin.instructions == "Be brief."


def test_items_become_the_chat_history_with_calls_and_their_results() -> None:
    """A replayed output message (its id, status and annotations pass), a call attached to the
    assistant message before it, a second call, their outputs as tool messages."""
    items = [
        {"role": "developer", "content": "Use tools."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "ping "}, {"type": "input_text", "text": "twice"}],
        },
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "On it.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_a",
            "name": "ping",
            "arguments": "{}",
            "status": "completed",
        },
        {"type": "function_call", "call_id": "call_b", "name": "ping", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "pong"},
        {
            "type": "function_call_output",
            "call_id": "call_b",
            "output": [{"type": "input_text", "text": "pong"}],
        },
    ]
    chat = decoded(input=items, tools=[PING])
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("developer", "Use tools."),
        ("user", "ping twice"),
        ("assistant", "On it."),
        ("tool", "pong"),
        ("tool", "pong"),
    ]
    assert [c.id for c in chat.messages[2].tool_calls or ()] == ["call_a", "call_b"]
    assert [m.tool_call_id for m in chat.messages[3:]] == ["call_a", "call_b"]
    # Calls with no assistant text before them: an assistant message of calls only.
    only_call = decoded(input=[items[1], items[4], items[6]], tools=[PING])
    assert [m.role for m in only_call.messages] == ["user", "assistant", "tool"]
    assert only_call.messages[1].content is None


def test_tools_choice_format_and_logprobs_map_to_the_chat_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = decoded(
        tools=[PING],
        tool_choice={"type": "function", "name": "ping"},
        parallel_tool_calls=False,
    )
    spec = chat.tool_spec()
    assert spec is not None and spec.mode == "named" and spec.name == "ping" and not spec.parallel
    assert spec.tools[0].parameters == PING["parameters"]
    formatted = decoded(
        text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}}
    )
    structured = formatted.structured_output()
    assert (
        structured is not None
        and structured.kind == "json"
        and msgspec.json.decode(structured.spec) == schema
    )
    assert decoded(text={"format": {"type": "json_object"}}).structured_output() is not None
    assert decoded(text={"format": {"type": "text"}}).structured_output() is None
    logprobs = decoded(include=["message.output_text.logprobs"], top_logprobs=3).to_sampling(room=10)
    assert logprobs.logprobs == 3
    assert decoded(ignore_eos=True).to_sampling(room=10).ignore_eos
    # Accepted with no effect, as on the chat endpoint.
    decoded(
        metadata={"run": "7"},
        user="u",
        prompt_cache_key="k",
        safety_identifier="s",
        store=False,
        background=False,
        truncation="disabled",
        reasoning={"effort": None},
        stream_options={"include_obfuscation": False},
        service_tier="auto",
        priority=-3,
    )


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "text", "indent": 2}}}, "text.format.indent"),
        ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"input": []}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
            "input[0].content[0].text",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
            "input[0].tool_call_id",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"tools": [PING, PING]}, "tools[1].name"),
        ({"tools": [{**PING, "colour": 1}]}, "tools[0].colour"),
        ({"tools": [PING], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tools": [PING], "tool_choice": {"type": "function", "name": "pong"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"max_output_tokens": "many"}, "max_output_tokens"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"seed": 3}, "seed"),
    ],
)
def test_a_field_not_served_is_a_400_naming_it_as_this_api_does(
    fields: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_responses(body(**fields))
    error = invalid(info.value)
    assert error.status == 400 and error.param == field, error.message


def test_the_chat_path_s_field_names_are_renamed() -> None:
    assert responses_field("max_tokens") == "max_output_tokens"
    assert responses_field("response_format.json_schema.schema") == "text.format.schema"
    assert responses_field("messages") == "input"
    assert responses_field("messages[1].content", ["instructions", "input[0]"]) == "input[0].content"
    assert responses_field("tools[2].function.parameters") == "tools[2].parameters"
    assert responses_field("logprobs") == "top_logprobs"
    assert responses_field("temperature") == "temperature"
    error = APIError(400, "max_tokens: must be at least 1", param="max_tokens").naming("max_output_tokens")
    assert (error.message, error.param) == ("max_output_tokens: must be at least 1", "max_output_tokens")


def as_json(payload: object) -> Any:
    return msgspec.json.decode(msgspec.json.encode(payload))


def renderer(chat: ResponsesChat, texts: TokenTexts | None = None) -> ResponsesRenderer:
    assert chat.origin is not None
    return ResponsesRenderer("resp_1", "m", chat.origin, texts, chat.tool_spec(), "default")


def test_a_whole_answer_is_a_response_the_client_parses() -> None:
    chat = decoded(instructions="Be brief.", max_output_tokens=2, metadata={"run": "7"})
    whole = OpenAIResponse.model_validate(
        as_json(renderer(chat).whole([ChoiceResult(0, "Hi", [], "length")], USAGE))
    )
    assert whole.output_text == "Hi" and whole.status == "incomplete"
    assert whole.incomplete_details is not None and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and (whole.usage.input_tokens, whole.usage.output_tokens) == (3, 2)
    details = whole.usage.input_tokens_details
    assert (details.cached_tokens, details.cache_write_tokens, whole.usage.total_tokens) == (1, 2, 5)
    assert (whole.instructions, whole.max_output_tokens, whole.metadata) == ("Be brief.", 2, {"run": "7"})
    assert whole.store is False and whole.service_tier == "default" and whole.id == "resp_1"
    done = OpenAIResponse.model_validate(
        as_json(renderer(chat).whole([ChoiceResult(0, "Hi.", [], "stop")], USAGE))
    )
    assert done.status == "completed" and done.incomplete_details is None


def test_calls_in_a_whole_answer_are_function_call_items_after_the_text() -> None:
    chat = decoded(tools=[PING])
    whole = OpenAIResponse.model_validate(
        as_json(renderer(chat).whole([ChoiceResult(0, "On it.\n" + CALL, [], "stop")], USAGE))
    )
    message, call = whole.output
    assert message.type == "message" and whole.output_text == "On it."
    assert call.type == "function_call" and (call.name, call.arguments) == ("ping", "{}")
    assert call.call_id and call.status == "completed" and whole.status == "completed"
    (only,) = OpenAIResponse.model_validate(
        as_json(renderer(chat).whole([ChoiceResult(0, CALL, [], "stop")], USAGE))
    ).output
    assert only.type == "function_call"
    # tool_choice none: the same text is the answer.
    plain = decoded(tools=[PING], tool_choice="none")
    text = OpenAIResponse.model_validate(
        as_json(renderer(plain).whole([ChoiceResult(0, CALL, [], "stop")], USAGE))
    )
    assert text.output_text == CALL


def stream(r: ResponsesRenderer, deltas: list[TokenDelta]) -> list[Any]:
    """The events of a stream, each checked against the client's type and its framing."""
    payloads = [*r.opening(0), *(p for d in deltas for p in r.chunks(0, d)), *r.closing(USAGE)]
    events = []
    for payload in payloads:
        framed = r.frame(payload)
        head, data = framed.split(b"\n", 1)
        event = EVENTS.validate_python(msgspec.json.decode(data.removeprefix(b"data: ")))
        assert head == f"event: {event.type}".encode() and framed.endswith(b"\n\n")
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert r.done == b""
    return events


def delta(
    text: str = "", finish: str | None = None, logprobs: list[TokenLogprob] | None = None
) -> TokenDelta:
    return TokenDelta(
        request_id="r", epoch=0, text=text, finish_reason=finish, usage=USAGE_SO_FAR, logprobs=logprobs
    )


def test_a_stream_is_the_api_s_events_ending_in_the_whole_response() -> None:
    events = stream(renderer(decoded()), [delta("He"), delta("llo"), delta(finish="stop")])
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[2].item.status == "in_progress" and events[2].item.content == []
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    assert events[6].text == "Hello" and events[8].item.status == "completed"
    final = events[-1].response
    assert final.output_text == "Hello" and final.status == "completed" and final.usage.output_tokens == 2
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_a_cut_answer_streams_as_incomplete() -> None:
    events = stream(renderer(decoded(max_output_tokens=1)), [delta("He", finish="length")])
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete"


def test_calls_stream_as_function_call_items_once_whole() -> None:
    pieces = ["On it.\n<tool", CALL[5:30], CALL[30:]]
    events = stream(renderer(decoded(tools=[PING])), [*(delta(p) for p in pieces), delta(finish="stop")])
    types = [e.type for e in events]
    assert types[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["message", "function_call"] and [
        e.output_index for e in added
    ] == [0, 1]
    # The message closes before the call opens; the call's arguments come whole.
    assert types.index("response.output_item.done") < types.index("response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert (done.name, done.arguments, done.output_index) == ("ping", "{}", 1)
    final = events[-1].response
    assert final.output_text == "On it.\n" and [i.type for i in final.output] == ["message", "function_call"]
    assert final.output[1].call_id == added[1].item.call_id and final.status == "completed"


def test_logprobs_ride_on_the_text_deltas_and_parts() -> None:
    texts = TokenTexts({1: b"he", 2: b"llo"}.__getitem__)
    chat = decoded(include=["message.output_text.logprobs"], top_logprobs=1)
    entries = [
        TokenLogprob(token_id=1, logprob=-0.1, top=[(1, -0.1)]),
        TokenLogprob(token_id=2, logprob=-0.2, top=[(2, -0.2)]),
    ]
    events = stream(
        renderer(chat, texts),
        [delta("he", logprobs=entries[:1]), delta("llo", finish="stop", logprobs=entries[1:])],
    )
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [[lp.token for lp in e.logprobs] for e in deltas] == [["he"], ["llo"]]
    final = events[-1].response.output[0].content[0]
    assert [(lp.token, lp.logprob) for lp in final.logprobs] == [("he", -0.1), ("llo", -0.2)]
    whole = OpenAIResponse.model_validate(
        as_json(renderer(chat, texts).whole([ChoiceResult(0, "hello", entries, "stop")], USAGE))
    )
    assert [lp.top_logprobs[0].token for lp in whole.output[0].content[0].logprobs] == ["he", "llo"]


def test_a_failure_midway_ends_the_stream_with_error_and_response_failed() -> None:
    r = renderer(decoded())
    payloads = [*r.opening(0), *r.chunks(0, delta("He"))]
    failure = APIError(502, "the worker running this request was lost: gone", code="worker_lost")
    payloads += r.failure(failure.body(), failure.status)
    events = [EVENTS.validate_python(as_json(p)) for p in payloads]
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "worker_lost" and "lost" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.output_text == "He"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_logprobs_with_tools_open_no_message_for_a_call() -> None:
    """Tokens held back while they may become a call carry logprobs, but no text: the stream's output
    is the call alone, as the whole answer's is."""
    texts = TokenTexts({1: b"<tool_call>"}.__getitem__)
    chat = decoded(tools=[PING], tool_choice="required", include=["message.output_text.logprobs"])
    entry = [TokenLogprob(token_id=1, logprob=-0.1, top=[])]
    events = stream(
        renderer(chat, texts), [delta("<tool_call>", logprobs=entry), delta(CALL[11:], finish="stop")]
    )
    assert [item.type for item in events[-1].response.output] == ["function_call"]
    whole = OpenAIResponse.model_validate(
        as_json(renderer(chat, texts).whole([ChoiceResult(0, CALL, entry, "stop")], USAGE))
    )
    assert [item.type for item in whole.output] == ["function_call"]
