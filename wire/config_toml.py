"""A configuration tree (``msgspec.to_builtins`` of a ServerConfig) written back as TOML.

    [section]            a top-level table
    [[tiers]]            a list of tables, top-level or in a section ([[models.pools]])
    key = { a = 1 }      any deeper table, inline; a deeper list of tables, an inline array

``None`` values are left out (TOML has no null, and every key that may be None defaults to None),
so ``tomllib.loads(dumps(tree))`` equals the tree without its None values. ``comments`` maps a
dotted path (``policies``, ``tiers.interactive``: a list element by its ``name``) to lines written
as ``# …`` just above it. Written here, not taken from a TOML library, because the server needs
only this much and must not grow a dependency for it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any


def dumps(tree: Mapping[str, Any], comments: Mapping[str, Sequence[str]] | None = None) -> str:
    notes = comments or {}
    lines: list[str] = []
    _comment(lines, notes.get(""))
    scalars = {k: v for k, v in tree.items() if not _is_table(v) and not _is_table_list(v)}
    _pairs(lines, scalars, "", notes)
    for key, value in tree.items():
        if _is_table(value):
            _table(lines, value, key, notes)
        elif _is_table_list(value):
            _table_list(lines, value, key, notes)
    return "\n".join(lines).strip("\n") + "\n"


def _table(lines: list[str], table: Mapping[str, Any], path: str, notes: Mapping[str, Sequence[str]]) -> None:
    lines.append("")
    _comment(lines, notes.get(path))
    lines.append(f"[{_key_path(path)}]")
    _pairs(lines, {k: v for k, v in table.items() if not _is_table_list(v)}, path, notes)
    for key, value in table.items():
        if _is_table_list(value):
            _table_list(lines, value, f"{path}.{key}", notes)


def _table_list(
    lines: list[str], tables: Sequence[Mapping[str, Any]], path: str, notes: Mapping[str, Sequence[str]]
) -> None:
    for table in tables:
        lines.append("")
        _comment(lines, notes.get(f"{path}.{table.get('name')}"))
        lines.append(f"[[{_key_path(path)}]]")
        _pairs(lines, table, path, notes)


def _pairs(lines: list[str], pairs: Mapping[str, Any], path: str, notes: Mapping[str, Sequence[str]]) -> None:
    for key, value in pairs.items():
        if value is None:
            continue
        _comment(lines, notes.get(f"{path}.{key}" if path else key))
        lines.append(f"{_key(key)} = {_value(value)}")


def _comment(lines: list[str], note: Sequence[str] | None) -> None:
    lines.extend(f"# {line}" if line else "#" for line in note or ())


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Mapping):
        items = [f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    if isinstance(value, Sequence):
        return "[" + ", ".join(_value(v) for v in value if v is not None) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}: {value!r}")


def _key(key: Any) -> str:
    text = str(key)
    bare = text and all(c.isascii() and (c.isalnum() or c in "-_") for c in text)
    return text if bare else json.dumps(text, ensure_ascii=False)


def _key_path(path: str) -> str:
    return ".".join(_key(part) for part in path.split("."))


def _is_table(value: Any) -> bool:
    return isinstance(value, Mapping)


def _is_table_list(value: Any) -> bool:
    return isinstance(value, list | tuple) and bool(value) and all(isinstance(v, Mapping) for v in value)
