"""The tools the tool-calling tests ask for (two weather functions) and the Hermes calls of them."""

from __future__ import annotations

import msgspec

from gateway.tools import NamedToolChoice, ToolDef, ToolSpec, tool_spec

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


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Lima", "days": 0}}\n</tool_call>'
