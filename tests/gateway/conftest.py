"""The gateway tests' shared fixtures."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gateway.dispatch import Dispatcher
from tests.gateway.mock_fleet import Fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # Bind port 0 once to learn a free port (and check LAST_ENDPOINT reads it back); each test binds it again.
    probe = Dispatcher("tcp://127.0.0.1:0")
    address = probe.address
    asyncio.run(probe.close())
    assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":0")
    fleet = Fleet(address, tmp_path_factory.mktemp("workers"))
    try:
        fleet.ensure_alive()
        yield fleet
    finally:
        fleet.close()
