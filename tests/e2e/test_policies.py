"""Policies end to end: a plugin from examples/ installed, selected in the config and changing what a
real ``tierserve serve`` does; and a broken selection stopping startup with its name.

The behaviour: one mock worker running one sequence at a time (8 admitted, the rest queue in the
worker), four requests with long prompts queue, then one with a short prompt. First come first served
makes the short one wait for all the long ones; the plugin's short-first ordering serves it next.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.launch import ROOT, Server, running_server
from tests.e2e.test_overload import metric
from tests.policies.test_plugin_install import install_example_plugin

pytestmark = pytest.mark.timeout(180)

BASE_CONFIG = """
[gateway]
max_in_flight_factor = 8.0

[[models.pools]]
name = "mock"
max_num_seqs = 1
"""
SHORT_FIRST = '\n[policies]\nordering = "short-first"\nallow_plugins = ["ordering.short-first"]\n'
TOKENS = 100  # 0.5 s of mock steps each
LONG_PROMPT = "a document to summarise. " * 40  # 1,000 tokens of the mock's byte tokenizer


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    site = install_example_plugin(tmp_path_factory.mktemp("plugin"))
    previous = os.environ.get("PYTHONPATH")
    # serve and its workers inherit it: that is how an installed plugin becomes visible to them.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *([previous] if previous else [])])
    yield site
    if previous is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = previous


def finish_order(server: Server) -> list[str]:
    async def main() -> list[str]:
        done: list[str] = []
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:

            async def one(name: str, prompt: str) -> None:
                body = {
                    "model": "mock",
                    "messages": [{"role": "user", "content": f"{name}: {prompt}"}],
                    "max_tokens": TOKENS,
                }
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                done.append(name)

            long = [asyncio.create_task(one(f"long-{i}", LONG_PROMPT)) for i in range(4)]
            # All four are on the worker (one running, three waiting) before the short one arrives.
            while metric((await client.get("/metrics")).text, "tierserve_admission_seats_in_use") < 4:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.6)  # a heartbeat later the worker has certainly queued them
            await asyncio.gather(one("short", "hello"), *long)
        return done

    return asyncio.run(main())


@pytest.mark.parametrize("short_first", [False, True], ids=["fcfs", "short-first"])
def test_the_plugin_is_loaded_and_changes_the_order(
    plugin_path: Path, tmp_path: Path, short_first: bool
) -> None:
    config = tmp_path / "tierserve.toml"
    config.write_text(BASE_CONFIG + (SHORT_FIRST if short_first else ""))
    with running_server(["--mock", "1", "--config", str(config)], tmp_path / "serve.log", 60) as server:
        order = finish_order(server)
    position = order.index("short")
    if short_first:
        assert position <= 2, order  # right after the request that was running (give or take a step)
    else:
        assert position == 4, order  # behind all the long ones


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        ('ordering = "no-such"', "policies.ordering: no ordering policy named 'no-such'"),
        ('ordering = "short-first"', "list it in policies.allow_plugins"),
        ('budget = { name = "slo-budget", params = { safty = 0.5 } }', "policies.budget.params"),
    ],
    ids=["unknown", "not-allowed", "bad-params"],
)
def test_a_bad_selection_stops_startup_naming_it(
    plugin_path: Path, tmp_path: Path, policies: str, message: str
) -> None:
    config = tmp_path / "tierserve.toml"
    config.write_text(f"[policies]\n{policies}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tierserve", "serve", "--mock", "1", "--port", "0", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
