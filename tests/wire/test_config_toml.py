"""The configuration written back as TOML reads back as the same configuration."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from wire.config import ServerConfig, load_config
from wire.config_toml import dumps

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tierserve.toml"


def without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [without_none(v) for v in value]
    return value


@pytest.mark.parametrize("source", [None, EXAMPLE], ids=["defaults", "example"])
def test_dumps_round_trips_a_config(source: Path | None, tmp_path: Path) -> None:
    config = load_config(source, env={}) if source else ServerConfig()
    text = dumps(msgspec.to_builtins(config))
    assert tomllib.loads(text) == without_none(msgspec.to_builtins(config))
    written = tmp_path / "again.toml"
    written.write_text(text)
    assert load_config(written, env={}) == config


def test_comments_go_above_what_they_name_and_odd_keys_are_quoted() -> None:
    tree = {"a": 1, "t": {"x": 'é\n"', "weird key": 2.5, "inline": {"0": True}}, "items": [{"name": "n1"}]}
    text = dumps(tree, {"": ["top"], "t": ["about t"], "items.n1": ["first item"], "t.x": ["why x"]})
    assert text.startswith("# top\na = 1\n")
    assert "# about t\n[t]\n# why x\nx = " in text
    assert '# first item\n[[items]]\nname = "n1"' in text
    assert tomllib.loads(text) == tree
