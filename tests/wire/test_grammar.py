"""wire.grammar: each kind of structured output becomes a grammar, and what the engine refuses is an
InvalidRequestError naming the request's field, fast, whatever the input."""

from __future__ import annotations

import json
import time

import pytest

from wire.errors import InvalidRequestError
from wire.grammar import check
from wire.structured import ANY_JSON_OBJECT, StructuredOutput

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def so(kind: str, spec: str, field: str = "f") -> StructuredOutput:
    return StructuredOutput(kind=kind, spec=spec, field=field)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("json", json.dumps(PERSON)),
        ("json", ANY_JSON_OBJECT),
        ("regex", r"[0-9]{3}-[a-z]+"),
        ("regex", r"(a+)+$"),  # catastrophic for a backtracking engine; derivatives do not care
        ("choice", json.dumps(["yes", "no", 'say "maybe"'])),
        ("grammar", 'start: "(" NUMBER ")"\nNUMBER: /[0-9]+/'),
    ],
)
def test_each_kind_is_accepted(kind: str, spec: str) -> None:
    assert check(so(kind, spec))


@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        ("json", "{not json", "not valid JSON"),
        ("json", "[1, 2]", "must be an object"),
        ("json", json.dumps({"type": "wizard"}), "wizard"),
        ("regex", "(a+", "unclosed group"),
        ("grammar", "start: foo", "unknown name"),
        ("choice", "[]", "non-empty list"),
        ("choice", json.dumps(["a", 3]), "non-empty list"),
    ],
)
def test_what_the_engine_refuses_names_the_field(kind: str, spec: str, reason: str) -> None:
    with pytest.raises(InvalidRequestError, match=reason) as info:
        check(so(kind, spec, field="response_format.json_schema.schema"))
    assert info.value.field == "response_format.json_schema.schema"


def deep_schema_text(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + '},"required":["a"]}' * depth


@pytest.mark.parametrize(("depth", "reason"), [(100, "recursion limit"), (5000, "nested too deeply")])
def test_a_deeply_nested_schema_is_refused_in_milliseconds(depth: int, reason: str) -> None:
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=reason):
        check(so("json", deep_schema_text(depth)))
    assert time.perf_counter() - start < 1.0
