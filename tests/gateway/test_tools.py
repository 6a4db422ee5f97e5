"""gateway.tools: the request's tools and tool_choice, the tool prompt and history, the call format a
template teaches, and the grammar a forced call is held to (the parsers: test_tool_calls.py)."""

from __future__ import annotations

import llguidance
import msgspec
import pytest

from gateway.chat_messages import ChatMessage
from gateway.chat_prompt import template_messages
from gateway.tools import ToolDef, call_format, grammar, tool_spec
from tests.gateway.tool_requests import CALL, CALL_2, spec
from wire.byte_tokenizer import BYTE_OFFSET, EOS_ID, VOCAB_SIZE, hf_tokenizer_json
from wire.grammar import LIMITS, check


def accepts(structured_grammar: str, text: str) -> bool:
    tokenizer = llguidance.LLTokenizer(hf_tokenizer_json(), n_vocab=VOCAB_SIZE, eos_token=EOS_ID)
    matcher = llguidance.LLMatcher(tokenizer, structured_grammar, log_level=0, limits=LIMITS)
    ok = matcher.consume_tokens([BYTE_OFFSET + b for b in text.encode()])
    return bool(ok) and not matcher.is_error() and matcher.is_accepting()


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
