"""Tool calling at the gateway: the request's tools in the prompt, the grammar that enforces a call,
and the format the model answers a call in (the parsers that find its calls: gateway/tool_calls.py).

A chat template that takes ``tools`` renders them itself (gateway/chat_prompt.py), and the model
answers a call as its template taught it (``call_format`` tells which from the template's text):
Hermes blocks (below; Qwen2.5, Hermes), Llama 3.1's JSON answer (``{"name": ..., "parameters": ...}``,
several separated by ``;``), or Mistral's ``[TOOL_CALLS]`` and a JSON list; under ``auto`` its answer
is read in that format (gateway/tool_calls.py). For any other template the prompt format is the Hermes
one, documented in docs/api.md ("Tool calling"):

- the tools' signatures go into the system message, inside ``<tools></tools>``, with the instruction to
  answer a call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- an assistant message's earlier ``tool_calls`` are written back the same way after its content;
- ``tool`` messages become a user message of ``<tool_response>\\n...\\n</tool_response>`` blocks
  (consecutive ones in one message).

``tool_choice``: ``none`` leaves the tools out of the prompt; ``auto`` lets the model choose and parses
what it wrote; ``required`` and a named function are enforced by a grammar in the Hermes format
whatever the template (gateway/openai_requests.py hands it to the engine as a structured output), so
the call's arguments always match the tool's JSON schema. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from wire.errors import InvalidRequestError
from wire.structured import StructuredOutput

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
NAME_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128


class FunctionDef(msgspec.Struct, kw_only=True):
    name: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; None: no arguments
    strict: bool | None = None  # every call is held to the schema whenever a grammar is used


class ToolDef(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionName


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallIn(msgspec.Struct, kw_only=True):
    """An assistant's earlier call, as the client sends the history back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


ChoiceMode = Literal["none", "auto", "required", "named"]
CallFormat = Literal["hermes", "llama3_json", "mistral"]
MISTRAL_OPEN = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's marker before a call (a special token, mostly skipped)


def call_format(template: str | None) -> CallFormat:
    """The call format a chat template teaches its model, from the template's text (None or one that
    does not take tools: the default, Hermes)."""
    if template is None:
        return "hermes"
    if MISTRAL_OPEN in template:
        return "mistral"
    if CALL_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or "ipython" in template:  # Llama 3.x: tool results are "ipython" turns
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """What a request asked for: its tools, how the model may use them, at most one call or several."""

    tools: tuple[FunctionDef, ...]
    mode: ChoiceMode
    parallel: bool = True
    name: str | None = None  # the function a named tool_choice asks for
    # How the placed model's template taught it to call (``call_format``): read under ``auto``.
    answer_format: CallFormat = "hermes"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def in_prompt(self) -> bool:
        """The tools go into the prompt, and calls are parsed out of the answer."""
        return self.mode != "none" and bool(self.tools)


def tool_spec(
    tools: Sequence[ToolDef] | None, choice: str | NamedToolChoice | None, parallel: bool | None
) -> ToolSpec | None:
    """The request's tool fields checked (400 naming the field); None when it has no tools."""
    functions = tuple(t.function for t in tools or ())
    if len(functions) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(functions)}")
    names = [f.name for f in functions]
    for i, function in enumerate(functions):
        if names.index(function.name) != i:
            raise InvalidRequestError(f"tools[{i}].function.name", f"{function.name!r} is given twice")
        if function.parameters is not None and function.parameters.get("type", "object") != "object":
            raise InvalidRequestError(
                f"tools[{i}].function.parameters", "must be the JSON schema of an object"
            )
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequestError(
                "tool_choice", f"names {choice.function.name!r}, which is not among the tools"
            )
        return ToolSpec(functions, "named", parallel is not False, choice.function.name)
    if choice not in (None, "none", "auto", "required"):
        raise InvalidRequestError(
            "tool_choice", f"must be none, auto, required or a function, got {choice!r}"
        )
    if not functions:
        if choice in ("auto", "required"):
            raise InvalidRequestError("tool_choice", f"{choice!r} needs tools")
        return None
    mode: ChoiceMode = "auto" if choice is None else choice  # type: ignore[assignment]
    return ToolSpec(functions, mode, parallel is not False)


# ---------------------------------------------------------------- the prompt


def system_prompt(spec: ToolSpec) -> str:
    """The tools section of the system message."""
    signatures = "\n".join(json.dumps({"type": "function", "function": _signature(f)}) for f in spec.tools)
    text = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    if spec.mode == "named":
        text += f"\n\nCall the function {spec.name}."
    elif spec.mode == "required":
        text += "\n\nYou must call at least one function." if spec.parallel else "\n\nCall one function."
    return text


def _signature(function: FunctionDef) -> dict[str, object]:
    out: dict[str, object] = {"name": function.name}
    if function.description is not None:
        out["description"] = function.description
    out["parameters"] = function.parameters if function.parameters is not None else {"type": "object"}
    return out


def call_text(name: str, arguments: object) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def history_arguments(calls: Sequence[ToolCallIn], field_prefix: str) -> list[object]:
    """An assistant's earlier calls' arguments, decoded (they must be JSON text; empty is ``{}``)."""
    out = []
    for j, call in enumerate(calls):
        try:
            out.append(json.loads(call.function.arguments) if call.function.arguments.strip() else {})
        except (ValueError, RecursionError):
            raise InvalidRequestError(
                f"{field_prefix}.tool_calls[{j}].function.arguments", "must be JSON text"
            ) from None
    return out


def history_calls_text(calls: Sequence[ToolCallIn], field_prefix: str) -> str:
    """An assistant's earlier calls as the model wrote them."""
    arguments = history_arguments(calls, field_prefix)
    return "\n".join(call_text(c.function.name, a) for c, a in zip(calls, arguments, strict=True))


def template_tools(spec: ToolSpec) -> list[dict[str, Any]]:
    """The tools as a chat template that takes them expects (OpenAI's shape)."""
    return [{"type": "function", "function": _signature(f)} for f in spec.tools]


def response_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


# ---------------------------------------------------------------- the grammar


def grammar(spec: ToolSpec) -> StructuredOutput | None:
    """The grammar a ``required`` or named tool_choice is held to (None for ``none``/``auto``): one call
    (named, or not parallel) or calls separated by a newline, each a tool's name and arguments valid
    against its schema."""
    if spec.mode not in ("required", "named"):
        return None
    tools = [t for t in spec.tools if spec.mode == "required" or t.name == spec.name]
    rules = []
    for i, tool in enumerate(tools):
        body = {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                "arguments": tool.parameters if tool.parameters is not None else {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
            # As the prompt shows a call (json.dumps' separators), with no other whitespace.
            "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        }
        rules.append(f"tool_{i}: %json {json.dumps(body)}")
    repeat = ' ("\\n" call)*' if spec.parallel and spec.mode == "required" else ""
    lark = "\n".join(
        [
            f"start: call{repeat}",
            f'call: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"',
            "body: " + " | ".join(f"tool_{i}" for i in range(len(tools))),
            *rules,
        ]
    )
    return StructuredOutput(
        kind="grammar", spec=lark, field="tool_choice" if spec.mode == "named" else "tools"
    )
