"""response_format and vLLM's structured_outputs become one StructuredOutput naming its field; every
shape the grammar engine could not take is refused by name (gateway/openai_requests.py)."""

from __future__ import annotations

import json

import msgspec
import pytest

from gateway.openai_requests import decode_chat, decode_completion
from gateway.structured import StructuredCheck
from wire.errors import InvalidRequestError
from wire.structured import ANY_JSON_OBJECT, MAX_SPEC_BYTES, StructuredOutput

MSG = {"role": "user", "content": "hi"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def structured_chat(**fields: object) -> StructuredOutput | None:
    body = msgspec.json.encode({"model": "m", "messages": [MSG], **fields})
    return decode_chat(body).to_sampling(room=100).structured


def test_response_format_maps_to_json_structured_outputs() -> None:
    assert structured_chat() is None
    assert structured_chat(response_format={"type": "text"}) is None
    any_object = structured_chat(response_format={"type": "json_object"})
    assert any_object == StructuredOutput(kind="json", spec=ANY_JSON_OBJECT, field="response_format")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    schema = structured_chat(response_format=fmt)
    assert schema is not None and schema.kind == "json" and json.loads(schema.spec) == SCHEMA
    assert schema.field == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("given", "kind", "spec"),
    [
        ({"json": SCHEMA}, "json", json.dumps(SCHEMA, separators=(",", ":"))),
        ({"json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA)),
        ({"json_object": True}, "json", ANY_JSON_OBJECT),
        ({"regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({"choice": ["yes", "no"]}, "choice", '["yes","no"]'),
        ({"grammar": 'start: "x"'}, "grammar", 'start: "x"'),
    ],
)
def test_vllm_structured_outputs_map_kind_by_kind(given: dict[str, object], kind: str, spec: str) -> None:
    for decode in ("chat", "completion"):
        if decode == "chat":
            structured = structured_chat(structured_outputs=given)
        else:
            body = msgspec.json.encode({"model": "m", "prompt": "p", "structured_outputs": given})
            structured = decode_completion(body).to_sampling(room=100).structured
        assert structured is not None
        assert (structured.kind, structured.spec) == (kind, spec)
        assert structured.field == f"structured_outputs.{next(iter(given))}"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs.structural_tag"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        ({"structured_outputs": {"regex": "a" * (MAX_SPEC_BYTES + 1)}}, "structured_outputs.regex"),
    ],
)
def test_shapes_that_cannot_be_served_are_refused_by_name(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        structured_chat(**fields)
    assert info.value.field == param


async def test_the_door_check_refuses_what_the_engine_would_and_remembers_what_it_took() -> None:
    check = StructuredCheck()
    await check(None)
    good = StructuredOutput(kind="regex", spec="[a-z]+", field="structured_outputs.regex")
    await check(good)
    await check(good)  # remembered
    with pytest.raises(InvalidRequestError) as info:
        await check(StructuredOutput(kind="regex", spec="(a+", field="structured_outputs.regex"))
    assert info.value.field == "structured_outputs.regex"
