"""Turning a TOML file and ``TIERSERVE_*`` variables into a typed Struct, with errors that name the key.

Generic over the schema (it walks ``msgspec.inspect`` type info), so ``wire/config.py`` stays the
schema alone. Environment overrides are applied to a plain tree of the already-decoded file config:

    TIERSERVE_TENANTS__0__MAX_TIER=batch   ->   tree["tenants"][0]["max_tier"] = "batch"

and ``origins`` remembers which variable set which key, so a later error blames the variable.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from msgspec import inspect as mi

T = TypeVar("T")
Segment = str | int

_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "str": "a string",
    "array": "a list",
    "object": "a table",
    "null": "nothing",
}


class ConfigError(ValueError):
    """A configuration mistake. ``key`` is the config path, or the variable itself when it is to blame."""

    def __init__(self, key: str, message: str, *, env_var: str | None = None) -> None:
        if env_var == key:
            text = f"{key}: {message}"
        elif env_var is not None:
            text = f"config error at {key} (set by {env_var}): {message}"
        else:
            text = f"config error at {key}: {message}"
        super().__init__(text)
        self.key = key
        self.message = message
        self.env_var = env_var


def format_key(segments: list[Segment]) -> str:
    """``["tenants", 1, "max_tier"]`` -> ``tenants[1].max_tier``."""
    out = ""
    for seg in segments:
        out += f"[{seg}]" if isinstance(seg, int) else (f".{seg}" if out else seg)
    return out


def blame(key: str, origins: Mapping[str, str]) -> str | None:
    """The variable that set ``key`` or a table/list above it, if any."""
    for origin, var in origins.items():
        if key == origin or key.startswith((origin + ".", origin + "[")):
            return var
    return None


def read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes().decode()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read the config file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(str(path), "the config file is not UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"invalid TOML: {exc}") from None


def decode(raw: Any, cls: type[T], origins: Mapping[str, str]) -> T:
    """``msgspec.convert`` whose errors become :class:`ConfigError` naming the key or the variable."""
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise _translate(str(exc), raw, mi.type_info(cls), origins) from None


def _translate(text: str, raw: Any, info: mi.Type, origins: Mapping[str, str]) -> ConfigError:
    at = _AT.search(text)
    segments: list[Segment] = []
    if at is not None:
        segments = [name if name else int(index) for name, index in _SEGMENT.findall(at["path"])]
        text = text[: at.start()]
    if unknown := re.fullmatch(r"Object contains unknown field `(.*)`", text):
        here = _unwrap(_type_at(info, segments))
        known = [f.name for f in here.fields] if isinstance(here, mi.StructType) else []
        segments.append(unknown[1])
        message = f"unknown key (known: {', '.join(known)})"
    elif missing := re.fullmatch(r"Object missing required field `(.*)`", text):
        segments.append(missing[1])
        message = "required key is missing"
    elif text.startswith("Invalid enum value"):
        here = _unwrap(_type_at(info, segments))
        # ``PosInt | Literal["auto"]``: the literal's words are the choices a person can type
        members = here.types if isinstance(here, mi.UnionType) else (here,)
        words = [str(v) for t in members if isinstance(t, mi.LiteralType) for v in t.values]
        words += ["an integer"] * any(isinstance(t, mi.IntType) for t in members)
        choices = ", ".join(words) or "?"
        message = f"invalid value{text.removeprefix('Invalid enum value')} (expected one of: {choices})"
    else:
        message = re.sub(r"`(\w+)`", lambda m: _TYPE_WORDS.get(m[1], m[1]), text)
        message = message[:1].lower() + message[1:]
        found, value = _lookup(raw, segments)
        secret = any("api_key" in str(seg) for seg in segments)  # never echo a key back into a log
        if found and not secret and isinstance(value, str | int | float | bool | None):
            shown = repr(value) if isinstance(value, str) else json.dumps(value)
            message = re.sub(r", got .*$", "", message) + f", got {shown}"
    key = format_key(segments) or "(top level)"
    var = blame(key, origins)
    if var is not None and origins.get(key) == var:
        return ConfigError(var, message, env_var=var)
    return ConfigError(key, message, env_var=var)


def env_overrides(
    base: msgspec.Struct, env: Mapping[str, str], *, prefix: str, ignore: frozenset[str]
) -> tuple[Any, dict[str, str]]:
    """``base`` as a plain tree with every ``<prefix><A>__<B>…`` variable applied, plus their origins."""
    info = mi.type_info(type(base))
    tree = msgspec.json.decode(msgspec.json.encode(base))  # plain dicts and lists: assignable
    origins: dict[str, str] = {}
    for var in sorted(env):  # sorted: the same variables always fail the same way
        if not var.startswith(prefix) or var in ignore:
            continue
        segments, leaf = _resolve(var, var[len(prefix) :].lower().split("__"), info)
        _assign(var, tree, segments, _parse_value(var, env[var], leaf))
        origins[format_key(segments)] = var
    return tree, origins


def _resolve(var: str, names: list[str], info: mi.Type) -> tuple[list[Segment], mi.Type]:
    segments: list[Segment] = []
    here = info
    for name in names:
        here = _unwrap(here)
        where = format_key(segments) or "the top level"
        if isinstance(here, mi.StructType):
            match = next((f for f in here.fields if f.name == name), None)
            if match is None:
                known = ", ".join(f.name for f in here.fields)
                raise _env_error(
                    var,
                    f"not a config key: {where} has no key {name!r} (known: {known}; levels join with '__')",
                )
            segments.append(name)
            here = match.type
        elif isinstance(here, mi.ListType | mi.VarTupleType) and name.isdigit():
            segments.append(int(name))
            here = here.item_type
        elif isinstance(here, mi.DictType) and name:
            segments.append(name)
            here = here.value_type
        else:
            raise _env_error(var, f"not a config key: cannot select {name!r} inside {where}")
    return segments, here


def _assign(var: str, tree: Any, segments: list[Segment], value: Any) -> None:
    node = tree
    for depth, seg in enumerate(segments):
        if isinstance(seg, int) and not seg < len(node):
            where = format_key(segments[:depth])
            raise _env_error(var, f"{where} has {len(node)} entries, so there is no index {seg}")
        if depth == len(segments) - 1:
            node[seg] = value
        else:
            if node[seg] is None and isinstance(segments[depth + 1], str):
                node[seg] = {}  # an optional table left unset (service_tiers): set one key of a new one
            node = node[seg]


def _parse_value(var: str, text: str, leaf: mi.Type) -> Any:
    """Strings stay verbatim; anything else is read as a TOML value, then as JSON, else kept as text."""
    here = _unwrap(leaf)
    if isinstance(here, mi.StrType) or (
        isinstance(here, mi.LiteralType) and all(isinstance(v, str) for v in here.values)
    ):
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(text)
    except ValueError:
        if text.lstrip()[:1] in ("[", "{", '"'):
            raise _env_error(var, f"cannot parse {text!r} as a TOML or JSON value") from None
        return text  # a bare word: decoding reports it against the expected type


def _env_error(var: str, message: str) -> ConfigError:
    return ConfigError(var, message, env_var=var)


def _type_at(info: mi.Type, segments: list[Segment]) -> mi.Type:
    here = info
    for seg in segments:
        here = _unwrap(here)
        if isinstance(here, mi.StructType):
            here = next((f.type for f in here.fields if f.name == seg), mi.AnyType())
        elif isinstance(here, mi.ListType | mi.VarTupleType):
            here = here.item_type
        elif isinstance(here, mi.DictType):
            here = here.value_type
        else:
            return mi.AnyType()
    return here


def _unwrap(info: mi.Type) -> mi.Type:
    """``X | None`` -> ``X``: a variable or an error talks about the type that can hold a value."""
    if isinstance(info, mi.UnionType):
        rest = [t for t in info.types if not isinstance(t, mi.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return info


def _lookup(tree: Any, segments: list[Segment]) -> tuple[bool, Any]:
    node = tree
    for seg in segments:
        try:
            node = node[seg]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, node
