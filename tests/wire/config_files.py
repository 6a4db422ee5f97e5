"""What the configuration tests share: the example file, a two-tenant file, and loading a text."""

from __future__ import annotations

from pathlib import Path

from wire.config import ServerConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tierserve.toml"
TWO_TENANTS = """
[[tenants]]
name = "a"
api_keys = ["key-a"]
[[tenants]]
name = "b"
api_keys = ["key-b"]
"""


def load_text(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> ServerConfig:
    path = tmp_path / "tierserve.toml"
    path.write_text(text)
    return load_config(path, env={} if env is None else env)
