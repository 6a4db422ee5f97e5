"""A request body's bytes as a msgspec Struct, every mistake an :class:`InvalidRequestError` naming the
field as the client wrote it (``messages[0].content``, ``structured_outputs.x``); shared by the
completion endpoints (gateway/openai_requests.py), the Responses API and ``/tokenize``.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from wire.errors import InvalidRequestError

_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


T = TypeVar("T")


def decode_body(body: bytes, kind: type[T]) -> T:
    """``body`` as ``kind``; a field that does not fit is an InvalidRequestError naming its path.
    A top-level field sent as ``null`` is taken as absent (its default), as OpenAI's API takes it:
    clients that serialise every optional field send ``"n": null``, ``"stream": null``."""
    try:
        try:
            return msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError:
            stripped = _without_top_level_nulls(body)
            if stripped is None:
                raise
            return msgspec.json.decode(stripped, type=kind)
    except msgspec.ValidationError as exc:
        raise invalid_field(exc) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError("body", f"not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError("body", "nested too deeply") from None


def invalid_field(exc: msgspec.ValidationError, within: str = "") -> InvalidRequestError:
    """msgspec's complaint naming the field as the client wrote it (``messages[0].content``), under
    ``within`` for a value taken from inside the body; an unknown key is an unrecognized argument."""
    message = str(exc)
    unknown, path = _UNKNOWN.search(message), _PATH.search(message)
    where = path.group(1) if path else ""
    if unknown is not None:  # "structured_outputs.x", or "x" at the top
        return InvalidRequestError(
            _field_path(within, where, unknown.group(1)),
            "unrecognized request argument: this server does not serve it",
        )
    if where or within:  # the object holding the bad or missing field
        return InvalidRequestError(_field_path(within, where), message)
    missing = _MISSING.search(message)  # at the top: the field itself; else the body
    return InvalidRequestError(missing.group(1) if missing else "body", message)


def _field_path(*parts: str) -> str:
    """Path pieces joined as written: ``input[0]`` + ``content[1].text``, ``tools[0]`` + ``[2]``."""
    out = ""
    for part in filter(None, parts):
        out += part if not out or part.startswith("[") else "." + part
    return out


def _without_top_level_nulls(body: bytes) -> bytes | None:
    """``body`` without its top-level ``null`` fields; None when it has none (or is not an object).
    Only the top level: below it a ``null`` can mean something (a JSON schema's ``"const": null``)."""
    try:
        value = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or all(v is not None for v in value.values()):
        return None
    return msgspec.json.encode({k: v for k, v in value.items() if v is not None})
