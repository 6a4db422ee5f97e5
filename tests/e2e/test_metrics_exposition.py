"""``GET /metrics`` of a real ``tierserve serve --mock 1`` after traffic, read by ``prometheus_client``'s
own text parser: every metric the observability issue lists is there, with its type and labels.

The traffic: the same 64-token prompt twice (the second finds it in the prefix cache), then eight
concurrent completions of 1,000 distinct prompt tokens and 100 output tokens, which need more than
the mock worker's 512 KV blocks: a preemption, and cached blocks evicted for other requests' KV.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from loadtest.launch import Server, running_server

pytestmark = pytest.mark.timeout(180)

DEADLINE_S = 60.0
NUM_PRESSURE = 8
PROMPT_LEN = 1000
MAX_TOKENS = 100
MT = {"model", "tier"}
WM = {"worker", "model"}

# The list, by family name (prometheus_client drops a counter's _total): type and label names.
EXPECTED: dict[str, tuple[str, set[str]]] = {
    # histograms per tier and model
    "tierserve_time_to_first_token_seconds": ("histogram", MT),
    "tierserve_time_per_output_token_seconds": ("histogram", MT),
    "tierserve_inter_token_latency_seconds": ("histogram", MT),
    "tierserve_e2e_request_latency_seconds": ("histogram", MT),
    "tierserve_queue_time_seconds": ("histogram", MT),
    # counters
    "tierserve_requests": ("counter", MT | {"status"}),
    "tierserve_prompt_tokens": ("counter", MT),
    "tierserve_output_tokens": ("counter", MT),
    "tierserve_cached_tokens": ("counter", MT),
    "tierserve_worker_preemptions": ("counter", WM),
    "tierserve_worker_kv_evictions": ("counter", WM),
    "tierserve_degraded": ("counter", MT),
    "tierserve_migrations": ("counter", {"model"}),
    "tierserve_shed": ("counter", MT),
    # gauges
    "tierserve_worker_requests_running": ("gauge", WM),
    "tierserve_worker_requests_waiting": ("gauge", WM),
    "tierserve_worker_kv_blocks_used": ("gauge", WM),
    "tierserve_worker_kv_blocks_total": ("gauge", WM),
    "tierserve_worker_prefix_cache_hit_ratio": ("gauge", WM),
    "tierserve_worker_step_time_seconds": ("gauge", WM),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("exposition")
    with running_server(["--mock", "1"], tmp / "serve.log", ready_timeout_s=60) as server:
        yield server


def distinct_prompt(i: int) -> list[int]:
    # Byte tokens (ids 4..259), distinct from the first token on: no prefix shared between requests.
    return [4 + (i * 97 + j * 31 + j * j) % 256 for j in range(PROMPT_LEN)]


async def traffic(base_url: str) -> list[int]:
    async with httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S) as client:

        async def one(prompt: list[int], tier: str, stream: bool) -> int:
            body = {"model": "mock", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream,
                    "ignore_eos": True}  # fmt: skip
            response = await client.post("/v1/completions", json=body, headers={"x-sla-tier": tier})
            return response.status_code

        shared = [4 + j % 200 for j in range(64)]
        statuses = [await one(shared, "standard", False) for _ in range(2)]  # the second: a cache hit
        pressure = [one(distinct_prompt(i), ("interactive", "batch")[i % 2], i % 3 == 0)
                    for i in range(NUM_PRESSURE)]  # fmt: skip
        return statuses + list(await asyncio.gather(*pressure))


def families(text: str) -> dict[str, Metric]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(family: Metric, sample_name: str, **labels: str) -> float:
    found = [s.value for s in family.samples if s.name == sample_name and labels.items() <= s.labels.items()]
    assert found, f"{sample_name}{labels}"
    return float(sum(found))


def test_every_listed_family_parses_with_its_type_and_labels(server: Server) -> None:
    assert asyncio.run(traffic(server.base_url)) == [200] * (2 + NUM_PRESSURE)
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the worker's counters arrive with its heartbeats (every 0.5 s)
        parsed = families(httpx.get(f"{server.base_url}/metrics", timeout=5).text)
        worker = {"worker": "mock-0", "model": "mock"}
        if (
            value(parsed["tierserve_worker_preemptions"], "tierserve_worker_preemptions_total", **worker) > 0
            and value(
                parsed["tierserve_worker_kv_evictions"], "tierserve_worker_kv_evictions_total", **worker
            )
            > 0
            and parsed["tierserve_worker_prefix_cache_hit_ratio"].samples
            and value(parsed["tierserve_worker_requests_running"], "tierserve_worker_requests_running") == 0
        ):
            break
        assert time.monotonic() < deadline, "no heartbeat showed the preemption, evictions and prefix hits"
        time.sleep(0.1)  # polling under a deadline
    for name, (kind, labels) in EXPECTED.items():
        family = parsed.get(name)
        assert family is not None, f"{name} missing from /metrics"
        assert family.type == kind, name
        assert family.documentation, name
        assert family.samples, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
    for family in parsed.values():  # the rest parses too, each with its help text
        assert family.documentation and family.type in ("counter", "gauge", "histogram"), family.name

    requests = parsed["tierserve_requests"]
    assert value(requests, "tierserve_requests_total", status="200") == 2 + NUM_PRESSURE
    for tier, count in (("standard", 2), ("interactive", NUM_PRESSURE // 2), ("batch", NUM_PRESSURE // 2)):
        series = {"model": "mock", "tier": tier}
        for name in ("tierserve_time_to_first_token_seconds", "tierserve_e2e_request_latency_seconds",
                     "tierserve_queue_time_seconds", "tierserve_time_per_output_token_seconds"):  # fmt: skip
            assert value(parsed[name], f"{name}_count", **series) == count, (name, tier)
        itl = "tierserve_inter_token_latency_seconds"
        assert value(parsed[itl], f"{itl}_count", **series) == count * (MAX_TOKENS - 1)  # one gap a step
        assert value(parsed["tierserve_shed"], "tierserve_shed_total", **series) == 0  # there, at 0
    assert value(parsed["tierserve_cached_tokens"], "tierserve_cached_tokens_total", tier="standard") > 0
    ratio = value(
        parsed["tierserve_worker_prefix_cache_hit_ratio"], "tierserve_worker_prefix_cache_hit_ratio"
    )
    assert 0 < ratio <= 1
    used = value(parsed["tierserve_worker_kv_blocks_used"], "tierserve_worker_kv_blocks_used")
    free = value(parsed["tierserve_worker_kv_blocks_free"], "tierserve_worker_kv_blocks_free")
    assert used + free == value(
        parsed["tierserve_worker_kv_blocks_total"], "tierserve_worker_kv_blocks_total"
    )
