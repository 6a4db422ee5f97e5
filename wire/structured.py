"""A structured output: what the answer must match, as the gateway sends it in ``SamplingParams``.

One kind per request, from OpenAI's ``response_format`` (``json_object``, ``json_schema``) or vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``):

    kind      spec
    json      a JSON schema, as JSON text (``json_object``: ``{"type": "object"}``)
    regex     a regular expression the whole answer matches
    choice    a JSON array of strings: the answer is exactly one of them
    grammar   a Lark grammar (llguidance's dialect; its ``start`` rule is the answer)

``field`` names the request field it came from, so an error about it names that field on both
sides of the wire. The grammar engine (llguidance) turns it into a token mask: ``wire.grammar``
checks it (gateway and worker alike), ``worker.structured`` applies it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_SPEC_BYTES = 256 * 1024  # a schema or grammar larger than this is refused before it is compiled

StructuredKind = Literal["json", "regex", "choice", "grammar"]
ANY_JSON_OBJECT = '{"type": "object"}'


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    kind: StructuredKind
    spec: Annotated[str, msgspec.Meta(max_length=MAX_SPEC_BYTES)]
    field: str = "structured_outputs"  # the request field, as the client wrote it
    # JSON only: the whitespace allowed between tokens (a regex); None: none at all (compact JSON,
    # which small models keep to better than "any whitespace").
    whitespace_pattern: Annotated[str, msgspec.Meta(max_length=1024)] | None = None

    @property
    def grammar_key(self) -> tuple[str, str, str | None]:
        """What decides the grammar (``field`` does not): the key both sides cache checks under."""
        return (self.kind, self.spec, self.whitespace_pattern)
