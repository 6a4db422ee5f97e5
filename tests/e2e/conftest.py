"""Fixtures for the end-to-end tests: ``tierserve serve --mock 2`` as a real process, one a module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from loadtest.launch import Server, running_server


@pytest.fixture(scope="module")
def mock_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """The server and its log (two mock workers, both ready)."""
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(["--mock", "2"], log_path, ready_timeout_s=60) as server:
        yield server, log_path


@pytest.fixture(scope="module")
def base_url(mock_server: tuple[Server, Path]) -> str:
    return mock_server[0].base_url


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=30, max_retries=0) as c:
        yield c
