"""gateway.tools: the tool prompt, the grammar a forced call is held to, and the call parser (the same
calls whether the text comes whole or in pieces)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import llguidance
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.openai_requests import ChatMessage, template_messages
from gateway.tools import (
    CallParser,
    NamedToolChoice,
    ToolDef,
    ToolSpec,
    WholeAnswerParser,
    answer_parser,
    call_format,
    grammar,
    parse_whole,
    tool_spec,
)
from wire.byte_tokenizer import BYTE_OFFSET, EOS_ID, VOCAB_SIZE, hf_tokenizer_json
from wire.grammar import LIMITS, check

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def tools(*names: str) -> list[ToolDef]:
    return msgspec.convert(
        [{"type": "function", "function": {"name": n, "parameters": WEATHER}} for n in names], list[ToolDef]
    )


def spec(choice: object = "auto", parallel: bool | None = None) -> ToolSpec:
    named = msgspec.convert(choice, NamedToolChoice) if isinstance(choice, dict) else choice
    result = tool_spec(tools("get_weather", "get_time"), named, parallel)  # type: ignore[arg-type]
    assert result is not None
    return result


def accepts(structured_grammar: str, text: str) -> bool:
    tokenizer = llguidance.LLTokenizer(hf_tokenizer_json(), n_vocab=VOCAB_SIZE, eos_token=EOS_ID)
    matcher = llguidance.LLMatcher(tokenizer, structured_grammar, log_level=0, limits=LIMITS)
    ok = matcher.consume_tokens([BYTE_OFFSET + b for b in text.encode()])
    return bool(ok) and not matcher.is_error() and matcher.is_accepting()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Lima", "days": 0}}\n</tool_call>'


def test_modes() -> None:
    assert tool_spec(None, None, None) is None and tool_spec(None, "none", None) is None
    assert spec().mode == "auto" and spec(None).mode == "auto" and spec("none").in_prompt is False
    named = spec({"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.name) == ("named", "get_time")
    assert spec("required", parallel=False).parallel is False


def test_the_tools_go_into_the_system_message_and_the_history_in_the_same_format() -> None:
    messages = msgspec.convert(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "windy"},
        ],
        list[ChatMessage],
    )
    out = template_messages(messages, spec())
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert (
        out[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert (
        out[3]["content"]
        == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwindy\n</tool_response>"
    )
    # tool_choice none: no tools in the prompt; no tools at all: no system message is made up.
    assert "# Tools" not in template_messages(messages, spec("none"))[0]["content"]
    assert template_messages(messages[1:2], None) == [{"role": "user", "content": "Weather in Oslo?"}]


def test_a_forced_call_is_held_to_the_tools_schemas() -> None:
    required = grammar(spec("required"))
    assert required is not None and grammar(spec()) is None
    compiled = check(required)
    assert accepts(compiled, CALL) and accepts(compiled, CALL + "\n" + CALL_2)
    assert not accepts(compiled, CALL.replace('"days": 2', '"days": "two"'))  # the schema's integer
    assert not accepts(compiled, CALL.replace("get_weather", "get_news"))  # no such tool
    assert not accepts(compiled, "Sure! " + CALL)  # nothing but calls
    one = check(grammar(spec("required", parallel=False)))  # type: ignore[arg-type]
    assert accepts(one, CALL) and not accepts(one, CALL + "\n" + CALL_2)
    named = check(grammar(spec({"type": "function", "function": {"name": "get_time"}})))  # type: ignore[arg-type]
    assert accepts(named, CALL_2) and not accepts(named, CALL)


def test_calls_are_parsed_out_of_a_whole_answer() -> None:
    content, calls = parse_whole(spec(), "Let me look.\n" + CALL + "\n" + CALL_2)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("get_time", {"city": "Lima", "days": 0}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_whole(spec(), CALL)[0] is None  # calls only: no content
    assert len(parse_whole(spec(parallel=False), CALL + CALL_2)[1]) == 1  # the first call only
    # Not a call of these tools, or not JSON: it stays content, and so does an unclosed block.
    for text in (
        CALL.replace("get_weather", "get_news"),
        "<tool_call>\n{oops}\n</tool_call>",
        "<tool_call>\n{",
    ):
        assert parse_whole(spec(), text) == (text, [])
    assert parse_whole(spec(), "I am a <tool_ fan") == ("I am a <tool_ fan", [])


@given(st.lists(st.integers(0, 200), max_size=8))
def test_streamed_in_any_pieces_the_parse_is_the_same(cuts: list[int]) -> None:
    text = "Checking <tools>.\n" + CALL + "\n" + CALL_2 + "\nDone <tool"
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    parser = CallParser(spec())
    content, names = "", []
    for a, b in itertools.pairwise(bounds):
        piece, calls = parser.feed(text[a:b])
        content += piece
        names += [c.name for c in calls]
    rest, more = parser.finish()
    content += rest
    assert not more
    whole_content, whole_calls = parse_whole(spec(), text)
    assert names == [c.name for c in whole_calls] == ["get_weather", "get_time"]
    assert content.strip() == whole_content


# The parts of Llama 3.1's, Mistral's and Qwen2.5's templates that tell their call formats apart.
LLAMA_TEMPLATE = (
    "{%- for m in messages %}{% if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>"
    '{% endif %}{{ m.content }}{% endfor %}{% if tools %}{"name": ..., "parameters": ...}{% endif %}'
)
MISTRAL_TEMPLATE = "{% for m in messages %}{{ m.content }}{% if m.tool_calls %}[TOOL_CALLS]{% endif %}"
HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}"


def test_the_call_format_is_read_from_the_template() -> None:
    assert call_format(LLAMA_TEMPLATE) == "llama3_json"
    assert call_format(MISTRAL_TEMPLATE) == "mistral"
    assert call_format(HERMES_TEMPLATE) == "hermes"
    assert call_format("{{ tools }}") == "hermes" and call_format(None) == "hermes"


def in_format(answer_format: str, choice: object = "auto", parallel: bool | None = None) -> ToolSpec:
    return dataclasses.replace(spec(choice, parallel), answer_format=answer_format)  # type: ignore[arg-type]


WEATHER_ARGS = {"city": "Oslo", "days": 2}
LLAMA_CALLS = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
    '{"name": "get_time", "parameters": {"city": "Lima", "days": 0}}'
)
MISTRAL_CALLS = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
    '{"name": "get_time", "arguments": "{\\"city\\": \\"Lima\\", \\"days\\": 0}"}]'
)


@pytest.mark.parametrize(
    ("answer_format", "text"),
    [
        ("llama3_json", LLAMA_CALLS),
        ("llama3_json", LLAMA_CALLS.removeprefix("<|python_tag|>")),  # the special token skipped
        ("mistral", MISTRAL_CALLS),
        ("mistral", MISTRAL_CALLS.removeprefix("[TOOL_CALLS]")),
    ],
)
def test_under_auto_the_answer_is_read_in_the_template_s_format(answer_format: str, text: str) -> None:
    content, calls = parse_whole(in_format(answer_format), "  " + text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", WEATHER_ARGS),
        ("get_time", {"city": "Lima", "days": 0}),
    ]
    assert len(parse_whole(in_format(answer_format, parallel=False), text)[1]) == 1
    # Text, an unknown tool, or a broken call: content, as written.
    for other in ("It is sunny.", text.replace("get_time", "get_news"), text[:-3], "[1] is a footnote"):
        assert parse_whole(in_format(answer_format), other) == (other, [])


@given(st.lists(st.integers(0, 300), max_size=8), st.sampled_from(["llama3_json", "mistral"]))
def test_a_whole_answer_call_streams_in_any_pieces_to_the_same_parse(
    cuts: list[int], answer_format: str
) -> None:
    for text in (LLAMA_CALLS if answer_format == "llama3_json" else MISTRAL_CALLS, "Plain <|words|> [here]"):
        bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
        parser = answer_parser(in_format(answer_format))
        assert isinstance(parser, WholeAnswerParser)
        content, names = "", []
        for a, b in itertools.pairwise(bounds):
            piece, calls = parser.feed(text[a:b])
            content, names = content + piece, names + [c.name for c in calls]
        rest, more = parser.finish()
        content, names = content + rest, names + [c.name for c in more]
        whole_content, whole_calls = parse_whole(in_format(answer_format), text)
        assert names == [c.name for c in whole_calls] and (content or None) == whole_content


def test_a_separator_inside_an_argument_is_part_of_it() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Oslo; Norway", "days": 1}}'
    (call,) = parse_whole(in_format("llama3_json"), text)[1]
    assert json.loads(call.arguments) == {"city": "Oslo; Norway", "days": 1}


def test_a_forced_call_is_read_as_the_grammar_writes_it_whatever_the_template() -> None:
    assert isinstance(answer_parser(in_format("llama3_json", "required")), CallParser)
    named = in_format("mistral", {"type": "function", "function": {"name": "get_time"}})
    assert isinstance(answer_parser(named), CallParser)
    assert isinstance(answer_parser(in_format("hermes")), CallParser)
    assert parse_whole(in_format("llama3_json", "required"), CALL)[1][0].name == "get_weather"


@pytest.mark.parametrize("parameters", [None, {"type": "object", "properties": {}}])
def test_a_tool_without_parameters_takes_an_object(parameters: object) -> None:
    function: dict[str, object] = {"name": "ping"}
    if parameters is not None:
        function["parameters"] = parameters
    defs = msgspec.convert([{"type": "function", "function": function}], list[ToolDef])
    forced = tool_spec(defs, "required", None)
    assert forced is not None
    compiled = check(grammar(forced))  # type: ignore[arg-type]
    assert accepts(compiled, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
