"""gateway.tool_calls: calls found in the model's text, the same ones whether the text comes whole or in
pieces, in the format the request's template taught (Hermes blocks, or a whole answer of calls)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.tool_calls import CallParser, WholeAnswerParser, answer_parser, parse_whole
from gateway.tools import ToolSpec
from tests.gateway.tool_requests import CALL, CALL_2, spec


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


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_answer_cut_short_hands_out_its_calls_never_markup(choice: object) -> None:
    """max_tokens or a stop string can end a grammar-held answer anywhere: its calls so far, and the cut
    one as far as it was written (its name, where it can be told, and the arguments' text so far,
    marked not whole), stream or whole; the Hermes markup never reaches the content."""
    text = CALL + "\n" + CALL_2 if choice == "required" else CALL
    forced = spec(choice)
    for cut in range(len(text) + 1):
        answer = text[:cut]
        content, calls = parse_whole(forced, answer)
        assert content in (None, ""), (answer, content)
        whole_calls = parse_whole(forced, text)[1]
        if calls:  # every call but the last is whole; the last is whole or cut where the text was cut
            assert [(c.name, c.arguments) for c in calls[:-1]] == [
                (c.name, c.arguments) for c in whole_calls[: len(calls) - 1]
            ]
            last, model = calls[-1], whole_calls[len(calls) - 1]
            assert last.name == model.name and model.arguments.startswith(last.arguments), (answer, last)
            assert last.arguments in answer
            # Only the last can be cut; a whole one has all its arguments (its finish: "tool_calls").
            assert all(c.whole for c in calls[:-1]) and (last.whole or cut < len(text))
            assert not last.whole or last.arguments == model.arguments, (answer, last)
        # A block is a call once it opens for a named choice; under required once its name so far is
        # one tool's alone (get_weather, get_time: from its fifth letter).
        blocks = [b.partition('{"name": "')[2] for b in answer.split("<tool_call>")[1:]]
        told = [b for b in blocks if choice != "required" or len(b) >= len("get_w")]
        assert len(calls) == len(told), (answer, calls)
        # Streamed in two pieces: the same calls.
        parser = CallParser(forced)
        streamed = [*parser.feed(answer[: cut // 2])[1], *parser.feed(answer[cut // 2 :])[1]]
        rest, more = parser.finish()
        assert rest == "" and [(c.name, c.arguments) for c in streamed + more] == [
            (c.name, c.arguments) for c in calls
        ]
    # Under auto a cut block is the model's own text: it stays content.
    assert parse_whole(spec(), CALL[:40]) == (CALL[:40], [])
