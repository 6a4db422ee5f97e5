"""Routing across a fleet, with real processes: prefix-aware placement, context-length pools, tenants.

``serve --mock N`` runs real workers (engine, scheduler, prefix cache, KV events) around a simulated
model. ``x-tierserve-worker`` names the worker a request was placed on; ``cached_tokens`` in usage is
what that worker's prefix cache served.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.failover_bench import metric, num_ready, scrape, wait_for, worker_processes
from loadtest.launch import Server, running_server

pytestmark = pytest.mark.timeout(180)

SYSTEM = "You are a careful assistant for the tierserve fleet; answer briefly and cite sources. " * 5
OTHER_SYSTEM = "Tu es un assistant prudent; reponds en francais, sans detour, et cite tes sources. " * 5


def complete(server: Server, prompt: str, key: str | None = None) -> tuple[str, int, httpx.Response]:
    """(worker, cached prompt tokens, response) of one greedy completion."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": "mock", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=30)
    if response.status_code != 200:
        return "", 0, response
    cached = int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return response.headers["x-tierserve-worker"], cached, response


# ---------------------------------------------------------------- prefix-aware routing

PREFIX_CONFIG = """
[gateway]
heartbeat_timeout_s = 1.5

[policies]
routing = "prefix-load"

[[tenants]]
name = "acme"
api_keys = ["acme-key"]

[[tenants]]
name = "globex"
api_keys = ["globex-key"]
"""


@pytest.fixture(scope="module")
def prefix_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("prefix-routing")
    (tmp / "tierserve.toml").write_text(PREFIX_CONFIG)
    args = ["--mock", "3", "--config", str(tmp / "tierserve.toml")]
    with running_server(args, tmp / "serve.log", 60) as server:
        wait_for(lambda: num_ready(server.base_url) == 3, 60, "three workers ready")
        yield server


def test_requests_sharing_a_system_prompt_follow_it_and_rebalance_when_its_worker_leaves(
    prefix_fleet: Server,
) -> None:
    placed = [
        complete(prefix_fleet, f"{SYSTEM}\nUser {i}: what is {i} squared?", "acme-key") for i in range(6)
    ]
    holders = {worker for worker, _, _ in placed}
    assert len(holders) == 1, f"a shared system prompt was spread over {holders}"
    (holder,) = holders
    assert all(cached >= 320 for _, cached, _ in placed[1:]), [cached for _, cached, _ in placed]

    # Another system prompt is free to go elsewhere; it too then sticks to one worker.
    others = {complete(prefix_fleet, f"{OTHER_SYSTEM}\nQ{i}?", "acme-key")[0] for i in range(4)}
    assert len(others) == 1

    os.kill(worker_processes(prefix_fleet)[holder], signal.SIGKILL)
    wait_for(lambda: num_ready(prefix_fleet.base_url) == 2, 30, "the holder ejected")
    after = [complete(prefix_fleet, f"{SYSTEM}\nUser {i}: and {i} cubed?", "acme-key") for i in range(5)]
    new_holders = {worker for worker, _, _ in after}
    assert len(new_holders) == 1 and holder not in new_holders, new_holders
    assert all(cached >= 320 for _, cached, _ in after[1:]), [cached for _, cached, _ in after]
    # /metrics shows the index: one snapshot asked of each worker when it registered, and the blocks
    # the new holder caches (from its KV events).
    text = scrape(prefix_fleet.base_url)
    assert metric(text, "tierserve_prefix_index_resyncs_total") >= 3
    (new_holder,) = new_holders
    assert metric(text, "tierserve_prefix_index_blocks", worker=new_holder) >= 20


def test_another_tenant_never_hits_a_prompt_it_did_not_send_on_any_worker(prefix_fleet: Server) -> None:
    """The gateway's index holds tenant-salted hashes: globex's prompt matches none of acme's blocks
    (on whatever worker it lands), so neither the cache nor the routing shares anything between them."""
    prompt = "A private system prompt that only acme has ever sent to this fleet, padded out. " * 4
    first, cached, _ = complete(prefix_fleet, prompt, "acme-key")
    assert cached == 0
    again, cached, _ = complete(prefix_fleet, prompt, "acme-key")
    assert again == first and cached > 0  # routed to its cache, and served from it
    _, cached, _ = complete(prefix_fleet, prompt, "globex-key")
    assert cached == 0
    _, cached, _ = complete(prefix_fleet, prompt, "globex-key")
    assert cached > 0  # globex's own blocks now


# ---------------------------------------------------------------- context-length pools

CONTEXT_CONFIG = """
[gateway]
context_classes = [
    { name = "short", max_prompt_tokens = 64 },
    { name = "medium", max_prompt_tokens = 128 },
    { name = "long" },
]

[[models.pools]]
name = "short-pool"
served_name = "smol"
context_classes = ["short"]
max_context = 1024

[[models.pools]]
name = "long-pool"
served_name = "smol"
context_classes = ["long"]
max_context = 8192
"""


@pytest.fixture(scope="module")
def context_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("context-routing")
    (tmp / "tierserve.toml").write_text(CONTEXT_CONFIG)
    args = ["--mock", "1", "--config", str(tmp / "tierserve.toml")]
    with running_server(args, tmp / "serve.log", 60) as server:
        wait_for(lambda: num_ready(server.base_url) == 2, 60, "both pools' workers ready")
        yield server


def test_the_context_class_picks_the_pool_and_a_prompt_no_pool_takes_is_a_400(context_fleet: Server) -> None:
    worker, _, response = complete(context_fleet, "short one")
    assert (worker, response.headers["x-context-class"]) == ("short-pool-0", "short")
    worker, _, response = complete(context_fleet, "x" * 400)
    assert (worker, response.headers["x-context-class"]) == ("long-pool-0", "long")

    _, _, refused = complete(context_fleet, "y" * 100)  # medium: neither pool takes it
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (
        error["code"] == "context_length_exceeded"
        and "no pool of model 'mock' takes medium" in error["message"]
    )

    _, _, too_long = complete(context_fleet, "z" * 9000)  # long, but past the long pool's 8192
    assert too_long.status_code == 400 and "context of 8192" in too_long.json()["error"]["message"]
    assert complete(context_fleet, "still serving")[2].status_code == 200
