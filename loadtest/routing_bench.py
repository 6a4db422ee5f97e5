"""The ``routing`` scenario: prefix-cache-aware routing (``prefix-load``) vs ``round-robin``, one run.

    tierserve bench routing --json [--record]           4 mock workers (block ``routing``)
    tierserve bench routing --real --json [--record]    2 workers of the embedded model (``routing-real``)

The ``shared-prefix`` workload (``--num-prefixes`` system prompts of ``--prefix-len`` tokens, each
followed by a short user message) as a closed loop of ``--concurrency`` users, seeded: the same
requests in the same order against two servers started one after the other with the same fleet, one
with ``routing = "prefix-load"``, one with ``routing = "round-robin"``. Both start cold; every request
counts (the cold misses of the first requests fall on both sides).

The fleet is sized so a worker's KV cache holds only a few of the system prompts (mock:
``--mock-kv-blocks`` of 16 tokens; real: ``--kv-cache-gb``), and a prompt token costs time to prefill
(mock: ``--mock-token-ms`` per scheduled token on top of ``--mock-step-ms`` per step; real: the model),
so a miss costs a real prefill and a hit skips it.

Figures (``*_prefix`` and ``*_rr`` for the two sides, ratios prefix / rr):

- ``ttft_p50_*``: median time to first token, ms; ``ttft_ratio`` (below 1: prefix routing is faster);
- ``hit_rate_*``: prompt tokens served from the prefix cache / prompt tokens, both from the responses'
  usage (``prompt_tokens_details.cached_tokens``); the user message and the chat template's tail are
  never cached, so it tops out a little below 1;
- ``request_hit_rate_*``: the share of requests that hit, a hit being at least ``HIT_FRACTION`` of the
  system prompt's own tokens served from the cache;
- ``output_tok_s_*``: output tokens / (first send to last completion); ``throughput_ratio``. A closed loop
  keeps the same number of requests in flight on both sides, so throughput is what the fleet sustains
  under each policy (an open loop below saturation would finish the same requests in the same time on
  both sides, and above it measure a queue rather than the fleet);
- placement, from each response's ``x-tierserve-worker``: requests per worker, the number of workers
  each system prompt was sent to and of system prompts each worker was sent; the preemptions and
  evicted cached blocks the workers reported.

``--prefix-params '{"balance_abs": 4}'`` runs prefix-load with other parameters (to study the policy;
the recorded figures use its defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtest.arrivals import ArrivalSpec
from loadtest.client import RequestOptions, Target
from loadtest.failover_bench import metric, num_ready, scrape, wait_for
from loadtest.figures import fmt, ratio, rounded
from loadtest.launch import Server, log_tail, running_server
from loadtest.metrics import GroupSummary, summarize
from loadtest.prompt_text import PromptTokenizer, load_tokenizer
from loadtest.records import RequestRecord
from loadtest.runner import Bounds, run_load
from loadtest.workloads import Api, Workload, WorkloadOptions, parse_range
from wire.config import ServerConfig

SIDES = {"prefix": "prefix-load", "rr": "round-robin"}  # label → policies.routing
HIT_FRACTION = 0.9  # of the system prompt's tokens, for a request to count as a hit
REAL_MODEL = "smollm2-135m-instruct"
READY_TIMEOUT_S = 300.0
HEARTBEAT_WAIT_S = 1.2  # serve's workers heartbeat every 0.5 s: the last counters reach /metrics by then


@dataclass(frozen=True, slots=True)
class Fleet:
    """What differs between the mock and the real run; the flags fill in what is not given."""

    num_workers: int
    num_requests: int
    concurrency: int
    num_prefixes: int
    prefix_len: int
    user_len: tuple[int, int]
    output_len: tuple[int, int]


MOCK = Fleet(4, 320, 16, 8, 1024, (16, 64), (32, 128))
REAL = Fleet(2, 64, 4, 4, 512, (16, 48), (16, 32))


def progress(message: str) -> None:
    print(f"[routing] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench routing", description=__doc__)
    parser.add_argument(
        "--real", action="store_true", help=f"{REAL.num_workers} workers of the embedded model"
    )
    parser.add_argument(
        "--workers", type=int, default=None, help=f"mock {MOCK.num_workers}, real {REAL.num_workers}"
    )
    parser.add_argument("--num-requests", type=int, default=None, help="per side")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (closed loop)")
    parser.add_argument("--num-prefixes", type=int, default=None, help="distinct system prompts")
    parser.add_argument("--prefix-len", type=int, default=None, help="tokens of each system prompt")
    parser.add_argument("--user-len", type=parse_range, default=None, metavar="LO:HI")
    parser.add_argument("--output-len", type=parse_range, default=None, metavar="LO:HI")
    parser.add_argument("--mock-step-ms", type=float, default=20.0, help="mock: fixed time per step")
    parser.add_argument("--mock-token-ms", type=float, default=0.1, help="mock: time per scheduled token")
    parser.add_argument("--mock-kv-blocks", type=int, default=256, help="mock: KV blocks of 16 tokens")
    parser.add_argument("--kv-cache-gb", type=float, default=0.032, help="real: KV cache per worker, GiB")
    parser.add_argument("--threads", type=int, default=1, help="real: torch threads per worker")
    parser.add_argument(
        "--prefix-params",
        type=json.loads,
        default={},
        metavar="JSON",
        help="prefix-load's params, e.g. '{\"balance_abs\": 4}' (default: the policy's defaults)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="client timeout per request, s")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    base = REAL if args.real else MOCK
    for name in (
        "workers",
        "num_requests",
        "concurrency",
        "num_prefixes",
        "prefix_len",
        "user_len",
        "output_len",
    ):
        if getattr(args, name) is None:
            setattr(args, name, getattr(base, "num_workers" if name == "workers" else name))
    return args


@dataclass(frozen=True, slots=True)
class SideResult:
    summary: GroupSummary
    records: list[RequestRecord]
    workers: dict[int, str]  # request index → the worker it was placed on (x-tierserve-worker)
    num_preemptions: int
    num_evictions: int


def run(args: argparse.Namespace) -> dict[str, object]:
    model = REAL_MODEL if args.real else "mock"
    tokenizer = load_tokenizer("auto", model)
    options = WorkloadOptions(
        prompt_len=args.user_len,
        output_len=args.output_len,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
    )
    load_before = os.getloadavg()[0]
    results: dict[str, SideResult] = {}
    workload = Workload("shared-prefix", tokenizer, Api.CHAT, args.seed, options)  # one request list
    with tempfile.TemporaryDirectory(prefix="routing-") as tmp, _threads(args):
        for side, policy in SIDES.items():
            config_path = Path(tmp) / f"{side}.toml"
            config_path.write_text(_config(args, policy))
            log_path = Path(tmp) / f"{side}.log"
            serve_args = ["--config", str(config_path)]
            if not args.real:
                mock_args = (
                    f"--mock-step-ms {args.mock_step_ms} --mock-token-ms {args.mock_token_ms} "
                    f"--mock-kv-blocks {args.mock_kv_blocks}"
                )
                serve_args += ["--mock", str(args.workers), "--mock-args", mock_args]
            try:
                with running_server(serve_args, log_path, READY_TIMEOUT_S) as server:
                    results[side] = _drive(server, model, workload, args)
            except BaseException:
                progress(f"{side}: the server's log ends with:\n{log_tail(log_path)}")
                raise
            s = results[side].summary
            progress(
                f"{side} ({policy}): TTFT p50 {fmt(s.ttft_ms.p50)} ms, {s.output_tok_s:.1f} tok/s, "
                f"cached {s.num_cached_tokens}/{s.num_prompt_tokens} prompt tokens, {s.num_ok} ok"
            )
    figures = _figures(args, model, tokenizer, results, workload)
    figures["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return figures


def _config(args: argparse.Namespace, policy: str) -> str:
    params = args.prefix_params if policy == "prefix-load" else {}
    table = ", ".join(f"{key} = {json.dumps(value)}" for key, value in params.items())
    text = f'[policies]\nrouting = {{ name = "{policy}", params = {{ {table} }} }}\n'
    if args.real:
        text += (
            f'\n[[models.pools]]\nname = "{REAL_MODEL}"\npath = "default"\n'
            f"num_workers = {args.workers}\nkv_cache_gb = {args.kv_cache_gb}\n"
        )
    return text


@contextmanager
def _threads(args: argparse.Namespace) -> Iterator[None]:
    """Real workers: ``--threads`` torch threads each (serve's workers inherit our environment), so two
    workers on two cores do not fight over them."""
    if not args.real:
        yield
        return
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    try:
        yield
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


class _Placements(httpx.AsyncBaseTransport):
    """The client's transport, noting each answer's ``x-tierserve-worker`` by the request's user
    message (unique per request in this workload)."""

    def __init__(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._inner = httpx.AsyncHTTPTransport(limits=limits)
        self.workers: dict[str, str] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        body = json.loads(request.content)
        self.workers[body["messages"][-1]["content"]] = response.headers.get("x-tierserve-worker", "")
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _drive(server: Server, model: str, workload: Workload, args: argparse.Namespace) -> SideResult:
    wait_for(
        lambda: num_ready(server.base_url, model) == args.workers,
        READY_TIMEOUT_S,
        f"{args.workers} workers ready",
    )  # /ready answers once one worker is up
    config = ServerConfig()
    target = Target("base", server.base_url, model, config.default_tier)
    options = RequestOptions(Api.CHAT, True, 0.0, False, {}, timeout_s=args.timeout)
    bounds = Bounds(args.num_requests, None, args.concurrency)
    placements = _Placements()
    result = asyncio.run(
        run_load([target], workload, ArrivalSpec(None), args.seed, bounds, options, transport=placements)
    )
    time.sleep(HEARTBEAT_WAIT_S)
    text = scrape(server.base_url)
    records = sorted(result.records, key=lambda r: r.index)
    duration = max(r.t_end for r in records) - min(r.t_sent for r in records)
    summary = summarize(records, {t.name: t for t in config.tiers}, duration).overall
    workers = {}
    for r in records:
        messages = workload.request(r.index).messages
        assert messages is not None
        workers[r.index] = placements.workers.get(messages[-1]["content"], "")
    return SideResult(
        summary,
        records,
        workers,
        int(metric(text, "tierserve_worker_preemptions_total")),
        int(metric(text, "tierserve_worker_kv_evictions_total")),
    )


def system_prompt_tokens(workload: Workload, tokenizer: PromptTokenizer, index: int) -> tuple[str, int]:
    """Request ``index``'s system prompt and its own token count (no chat template)."""
    messages = workload.request(index).messages
    assert messages is not None and messages[0]["role"] == "system"
    text = messages[0]["content"]
    return text, len(tokenizer.builder.text_ids(text))


def request_hits(
    records: Sequence[RequestRecord], workload: Workload, tokenizer: PromptTokenizer
) -> list[bool]:
    """Per successful record: at least ``HIT_FRACTION`` of its system prompt's tokens came from the cache."""
    return [
        (r.num_cached_tokens or 0) >= HIT_FRACTION * system_prompt_tokens(workload, tokenizer, r.index)[1]
        for r in records
        if r.is_ok
    ]


def _figures(
    args: argparse.Namespace,
    model: str,
    tokenizer: PromptTokenizer,
    results: dict[str, SideResult],
    workload: Workload,
) -> dict[str, object]:
    groups: dict[str, str] = {}  # system prompt → "P0", "P1", … in order of first use
    for i in range(args.num_requests):
        text, _ = system_prompt_tokens(workload, tokenizer, i)
        groups.setdefault(text, f"P{len(groups)}")
    prefix, rr = results["prefix"], results["rr"]
    figures: dict[str, object] = {
        "scenario": "routing-real" if args.real else "routing",  # --record's block
        "model": model,
        "workers": args.workers,
        "fleet": (
            f"mock: {args.mock_step_ms:g} ms/step + {args.mock_token_ms:g} ms/scheduled token, "
            f"{args.mock_kv_blocks} KV blocks of 16 tokens"
            if not args.real
            else f"{REAL_MODEL}, kv_cache_gb {args.kv_cache_gb:g}, {args.threads} thread(s) per worker"
        ),
        "workload": (
            f"shared-prefix: {args.num_prefixes} system prompts of {args.prefix_len} tokens, user "
            f"{args.user_len[0]}-{args.user_len[1]}, output {args.output_len[0]}-{args.output_len[1]} "
            "tokens (max_tokens; greedy), streamed chat"
        ),
        "arrivals": f"closed loop of {args.concurrency}",
        "num_requests": args.num_requests,
        "seed": args.seed,
        "prefix_load_params": args.prefix_params or "defaults",
    }
    for side, result in results.items():
        figures[f"completed_{side}"] = result.summary.num_ok
    for side, result in results.items():
        figures[f"ttft_p50_{side}"] = rounded(result.summary.ttft_ms.p50)
    figures["ttft_ratio"] = ratio(prefix.summary.ttft_ms.p50, rr.summary.ttft_ms.p50)
    for side, result in results.items():
        figures[f"ttft_p90_{side}"] = rounded(result.summary.ttft_ms.p90)
    for side, result in results.items():
        s = result.summary
        figures[f"hit_rate_{side}"] = rounded(
            s.num_cached_tokens / s.num_prompt_tokens if s.num_prompt_tokens else None
        )
    for side, result in results.items():
        hits = request_hits(result.records, workload, tokenizer)
        figures[f"request_hit_rate_{side}"] = rounded(sum(hits) / len(hits) if hits else None)
    for side, result in results.items():
        figures[f"output_tok_s_{side}"] = round(result.summary.output_tok_s, 2)
    figures["throughput_ratio"] = ratio(prefix.summary.output_tok_s, rr.summary.output_tok_s)
    for side, result in results.items():
        figures[f"prompt_tokens_{side}"] = result.summary.num_prompt_tokens
        figures[f"cached_tokens_{side}"] = result.summary.num_cached_tokens
        figures[f"output_tokens_{side}"] = result.summary.num_output_tokens
    for side, result in results.items():
        figures[f"requests_per_worker_{side}"] = dict(sorted(Counter(result.workers.values()).items()))
    for side, result in results.items():
        workers_of: dict[str, set[str]] = {}  # system prompt label → the workers it was sent to
        prompts_of: dict[str, set[str]] = {}  # worker → the system prompts it was sent
        for index, worker in result.workers.items():
            label = groups[system_prompt_tokens(workload, tokenizer, index)[0]]
            workers_of.setdefault(label, set()).add(worker)
            prompts_of.setdefault(worker, set()).add(label)
        figures[f"workers_per_system_prompt_{side}"] = {
            g: len(workers_of[g]) for g in sorted(workers_of, key=_group_key)
        }
        figures[f"system_prompts_per_worker_{side}"] = {w: len(prompts_of[w]) for w in sorted(prompts_of)}
    for side, result in results.items():
        figures[f"preemptions_{side}"] = result.num_preemptions
        figures[f"evictions_{side}"] = result.num_evictions
    return figures


def _group_key(label: str) -> int:
    return int(label[1:])
