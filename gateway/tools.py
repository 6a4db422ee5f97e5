"""Tool calling at the gateway: the request's tools in the prompt, the grammar that enforces a call,
and the parser that finds calls in the model's text (streamed or whole).

A chat template that takes ``tools`` renders them itself (openai_requests.chat_prompt), and the model
answers a call as its template taught it (``call_format`` tells which from the template's text):
Hermes blocks (below; Qwen2.5, Hermes), Llama 3.1's JSON answer (``{"name": ..., "parameters": ...}``,
several separated by ``;``), or Mistral's ``[TOOL_CALLS]`` and a JSON list; under ``auto`` its answer
is read in that format (``answer_parser``). For any other template the prompt format is the Hermes one,
documented in docs/api.md ("Tool calling"):

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
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
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


# ---------------------------------------------------------------- parsing the model's text


@dataclass(frozen=True, slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(slots=True)
class CallParser:
    """Feeds on the model's text as it streams; hands out the content between calls and each call
    once its block closes. Text that may still become ``<tool_call>`` is held back until it cannot.
    A block whose body is not a call of one of the tools (not JSON, an unknown name) is content. With
    ``parallel`` false only the first call is kept. ``finish`` flushes what is held."""

    spec: ToolSpec
    calls: list[ParsedCall] = field(default_factory=list)
    _held: str = ""
    _in_call: bool = False
    _gap: str = ""  # whitespace since the last call: content only if more text follows it

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._held += text
        content: list[str] = []
        found: list[ParsedCall] = []
        while True:
            if self._in_call:
                end = self._held.find(CALL_CLOSE)
                if end < 0:
                    break
                body, self._held = self._held[:end], self._held[end + len(CALL_CLOSE) :]
                self._in_call = False
                call = self._call(body)
                if call is None:
                    self._emit(CALL_OPEN + body + CALL_CLOSE, content)
                elif self.spec.parallel or not self.calls:
                    self.calls.append(call)
                    found.append(call)
                    self._gap = ""  # the newlines between calls are not content
                continue
            start = self._held.find(CALL_OPEN)
            if start >= 0:
                self._emit(self._held[:start], content)
                self._held = self._held[start + len(CALL_OPEN) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._held, CALL_OPEN)
            self._emit(self._held[: len(self._held) - keep], content)
            self._held = self._held[len(self._held) - keep :]
            break
        return "".join(content), found

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """What is still held (an unclosed block, a partial tag), as content (trailing whitespace
        after the last call dropped); no call is found here."""
        content: list[str] = []
        self._emit((CALL_OPEN if self._in_call else "") + self._held, content)
        self._held, self._in_call, self._gap = "", False, ""
        return "".join(content), []

    def _emit(self, text: str, out: list[str]) -> None:
        if not self.calls:
            out.append(text)
            return
        self._gap += text
        if self._gap.strip():
            out.append(self._gap)
            self._gap = ""

    def _call(self, body: str) -> ParsedCall | None:
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            return None
        return _parsed(value, self.spec.names)


@dataclass(slots=True)
class WholeAnswerParser:
    """Reads calls written as the whole answer, as Llama 3.1 (``{"name": ..., "parameters": {...}}``,
    several separated by ``;``, perhaps after ``<|python_tag|>``) and Mistral (``[TOOL_CALLS]`` then a
    JSON list of ``{"name": ..., "arguments": {...}}``; the tag is a special token, so its text may
    be missing) write them. An answer that starts (past whitespace) as calls would is held until it
    ends, then parsed: calls when every part is a call of one of the tools, else content as it was;
    any other answer streams as content. With ``parallel`` false only the first call is kept."""

    spec: ToolSpec
    calls: list[ParsedCall] = field(default_factory=list)
    _held: str = ""
    _holding: bool | None = None  # None: not yet known (only whitespace so far)

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self._holding is False:
            return text, []
        self._held += text
        start = self._held.lstrip()
        if not start:
            return "", []
        openings = ("{", PYTHON_TAG) if self.spec.answer_format == "llama3_json" else ("[", MISTRAL_OPEN)
        if any(start.startswith(o) for o in openings):
            self._holding = True
            return "", []
        if any(o.startswith(start) for o in openings):
            return "", []  # a partial opening: it may still become one
        self._holding = False
        out, self._held = self._held, ""
        return out, []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        held, self._held = self._held, ""
        if not self._holding:
            return held, []
        calls = self._parse(held.strip())
        if calls is None:
            return held, []
        self.calls = calls if self.spec.parallel else calls[:1]
        return "", list(self.calls)

    def _parse(self, text: str) -> list[ParsedCall] | None:
        values: list[object] = []
        try:
            if self.spec.answer_format == "mistral":
                listed = json.loads(text.removeprefix(MISTRAL_OPEN).strip())
                values = listed if isinstance(listed, list) else [listed]
            else:
                values = _json_values(text.removeprefix(PYTHON_TAG), ";")
        except (ValueError, RecursionError):
            return None
        calls = [_parsed(v, self.spec.names) for v in values]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]


AnswerParser = CallParser | WholeAnswerParser


def answer_parser(spec: ToolSpec) -> AnswerParser:
    """The parser for the model's answer: under ``auto`` in the format its template taught it;
    otherwise (the grammar's) Hermes."""
    if spec.mode == "auto" and spec.answer_format != "hermes":
        return WholeAnswerParser(spec)
    return CallParser(spec)


def _json_values(text: str, separator: str) -> list[object]:
    """The JSON values of ``text``, one after another, ``separator`` and whitespace between them
    (ValueError where that is not what it holds)."""
    decoder, i = json.JSONDecoder(), 0
    values: list[object] = []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if values and i < len(text):  # after a value: the separator, then the next one
            if text[i] != separator:
                raise ValueError(f"expected {separator!r} at {i}")
            i += 1
            while i < len(text) and text[i].isspace():
                i += 1
        if i >= len(text):
            return values
        value, i = decoder.raw_decode(text, i)
        values.append(value)


def _parsed(value: object, names: frozenset[str]) -> ParsedCall | None:
    """A call of one of ``names`` from its JSON value (``arguments``, or Llama's ``parameters``; an
    object, or JSON text of one as some models write it), else None."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], json.dumps(arguments))


def parse_whole(spec: ToolSpec, text: str) -> tuple[str | None, list[ParsedCall]]:
    """The content (None when there are calls and nothing else) and the calls in a whole answer."""
    parser = answer_parser(spec)
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    content, calls = content + rest, calls + more
    if not calls:
        return content, []
    content = content.strip()
    return content or None, calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
