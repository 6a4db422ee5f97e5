"""Tool calls in the model's text, streamed or whole: found, checked against the request's tools, and
handed out once each, with the content around them.

The format is the one the request's ``ToolSpec`` names (gateway/tools.py decides it from the chat
template): Hermes ``<tool_call>`` blocks, which ``CallParser`` finds as the text streams, or a whole
answer of calls as Llama 3.1 and Mistral write them, which ``WholeAnswerParser`` holds until it ends.
Whatever the format, a call names one of the tools and its arguments are a JSON object; anything else
is content. Torch-free.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from gateway.tools import CALL_CLOSE, CALL_OPEN, MISTRAL_OPEN, PYTHON_TAG, ToolSpec

FORCED = ("required", "named")  # the tool_choice modes whose answer a grammar writes: calls only
_CALL_NAME = '{"name": "'  # how the grammar begins a call's JSON (gateway/tools.py grammar)
_CALL_ARGUMENTS = ', "arguments": '  # what follows the name's closing quote

__all__ = ["AnswerParser", "CallParser", "ParsedCall", "WholeAnswerParser", "answer_parser", "parse_whole"]


@dataclass(frozen=True, slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text
    whole: bool = True  # False: a forced call cut short, its arguments as far as they were written


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
        after the last call dropped). Under a forced tool_choice the answer is the grammar's calls only,
        and an unclosed block is a call cut short (``max_tokens``): it is handed out as a call with the
        arguments written so far (as OpenAI hands out a cut-off call; the finish stays "length"), not
        as Hermes markup in the content."""
        content: list[str] = []
        found: list[ParsedCall] = []
        if self.spec.mode not in FORCED:
            self._emit((CALL_OPEN if self._in_call else "") + self._held, content)
        elif self._in_call:  # (outside a block a forced answer holds at most a partial tag: dropped)
            call = _cut_call(self._held, self.spec)
            if call is not None and (self.spec.parallel or not self.calls):
                self.calls.append(call)
                found.append(call)
        self._held, self._in_call, self._gap = "", False, ""
        return "".join(content), found

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
    return ParsedCall(_call_id(), value["name"], json.dumps(arguments))


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


def _cut_call(text: str, spec: ToolSpec) -> ParsedCall | None:
    """A forced call's block cut short: ``text`` is what followed ``<tool_call>``, a prefix of the
    grammar's ``\n{"name": "NAME", "arguments": ARGS}\n</tool_call>``. The call of its name (before the
    name is whole: a named choice's, or the one tool it can still be) with ARGS as far as they go (JSON
    text that may not parse: the call was cut off); None where the name cannot be told."""
    body = text.removeprefix("\n")
    try:  # whole, cut inside the closing tag
        value, _ = json.JSONDecoder().raw_decode(body)
    except (ValueError, RecursionError):
        value = None
    if (call := _parsed(value, spec.names)) is not None:
        return call
    if body.startswith(_CALL_NAME):
        name, quote, after = body[len(_CALL_NAME) :].partition('"')
        if quote:  # the name is whole
            if name not in spec.names:
                return None
            arguments = after.removeprefix(_CALL_ARGUMENTS) if after.startswith(_CALL_ARGUMENTS) else ""
            return ParsedCall(_call_id(), name, arguments, whole=False)
    elif _CALL_NAME.startswith(body):
        name = ""
    else:
        return None  # not the grammar's text
    possible = [spec.name] if spec.mode == "named" else sorted(n for n in spec.names if n.startswith(name))
    if len(possible) != 1 or possible[0] is None:
        return None
    return ParsedCall(_call_id(), possible[0], "", whole=False)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
