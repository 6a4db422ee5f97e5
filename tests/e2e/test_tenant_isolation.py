"""Tenant-salted prefix caches, end to end: the same prompt hits the cache for its own tenant only.

A real ``serve --mock 1`` with two keyed tenants; ``usage.prompt_tokens_details.cached_tokens`` is what
the worker's prefix cache served.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.launch import Server, running_server

pytestmark = pytest.mark.timeout(120)

CONFIG = """
[[tenants]]
name = "acme"
api_keys = ["acme-key"]

[[tenants]]
name = "globex"
api_keys = ["globex-key"]
"""
PROMPT = "A long shared system prompt that spans several KV blocks of sixteen tokens each. " * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("tenants")
    (tmp / "tierserve.toml").write_text(CONFIG)
    with running_server(["--mock", "1", "--config", str(tmp / "tierserve.toml")], tmp / "serve.log", 60) as s:
        yield s


def cached_tokens(server: Server, key: str) -> int:
    body = {"model": "mock", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    response = httpx.post(
        f"{server.base_url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_prompt_hits_the_cache_of_its_own_tenant_only(server: Server) -> None:
    assert cached_tokens(server, "acme-key") == 0
    assert cached_tokens(server, "acme-key") > 0  # the same tenant again: served from the cache
    assert cached_tokens(server, "globex-key") == 0  # the same prompt, another tenant: nothing shared
    assert cached_tokens(server, "globex-key") > 0
