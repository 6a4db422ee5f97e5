"""A structured output as the grammar engine's grammar, and the check both sides of the wire run.

The engine is llguidance (no dependencies, torch-free): a regex or JSON schema becomes a grammar whose
lexer is built from regex derivatives, so a pattern like ``(a+)+$`` costs no backtracking, and every
construction is bounded by the parser limits below (``LIMITS``), so a hostile schema fails fast with
an error instead of stalling a worker. Why llguidance and not xgrammar: docs/api.md
("Structured outputs").
"""

from __future__ import annotations

import json
import re

import llguidance

from wire.errors import InvalidRequestError
from wire.structured import StructuredOutput

# llguidance's defaults, but with shorter errors (no grammar dump in a 400) and a smaller grammar cap.
LIMITS = llguidance.LLParserLimits(max_grammar_size=200_000, verbose_errors=False)
_EXCERPT = re.compile(r"^(\d+ \||\^)")


def to_grammar(structured: StructuredOutput) -> str:
    """llguidance's grammar (JSON text) for ``structured``; InvalidRequestError naming its field when
    the spec is not even well-formed (a schema that is not JSON, choices that are not strings)."""
    kind, spec = structured.kind, structured.spec
    if kind == "json":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise InvalidRequestError(structured.field, f"not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidRequestError(structured.field, "nested too deeply") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError(structured.field, "a JSON schema must be an object")
        options: dict[str, object] = {"whitespace_flexible": False}
        if structured.whitespace_pattern is not None:
            options = {"whitespace_pattern": structured.whitespace_pattern}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        except ValueError as exc:
            raise InvalidRequestError(structured.field, str(exc)) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except (ValueError, RecursionError):
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError(structured.field, "must be a non-empty list of non-empty strings")
        # each choice a Lark string literal (JSON's escaping is Lark's)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return llguidance.LLMatcher.grammar_from_lark(spec)


def check(structured: StructuredOutput) -> str:
    """The grammar for ``structured`` once the engine accepts it; InvalidRequestError naming the
    field with the engine's reason otherwise (bounded by ``LIMITS``: milliseconds, even for a
    schema nested thousands deep)."""
    grammar = to_grammar(structured)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=LIMITS)
    if is_error:
        reason = _one_line(messages[0]) if messages else "rejected by the grammar engine"
        raise InvalidRequestError(structured.field, f"cannot be used as a structured output: {reason}")
    return grammar


def _one_line(message: str, limit: int = 300) -> str:
    """The engine's message without its source excerpt (``  1 | start: ...`` and the caret line)."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and not _EXCERPT.match(line)]
    text = " ".join(kept)
    return text if len(text) <= limit else text[: limit - 1] + "…"
