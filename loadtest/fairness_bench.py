"""The ``fairness`` scenario: a light tenant's TTFT through one gateway, alone and while a heavy tenant
floods another gateway of the same fleet, in one run.

    tierserve bench fairness --json [--record]      one worker of the embedded model
    tierserve bench fairness --mock --json          a mock worker (plumbing: a mock step costs no compute)

    gateway A: serve --no-workers  ◀── tenant "heavy": a closed loop of --heavy-concurrency (past saturation)
    gateway B: serve --no-workers  ◀── tenant "light": seeded Poisson arrivals, --light-rate req/s
    one worker: tierserve worker --connect A --connect B --policies {ordering: --ordering}

Both tenants' requests are of one tier and no gateway sees the other's traffic, so whatever protects
light is the worker's ordering (``tiered``: fair between tenants within a tier). Light's seeded load
runs twice on the same fleet, for ``--duration`` seconds each: alone (the baseline), then once the flood has
filled the worker's queue (its waiting requests, from the heartbeats B shows), with the same lengths
and arrival times but another text (so the second phase gets no prefix hits from the first). Every request is
streamed and waited for (client timeout ``--timeout``).

Light is light on any machine: without ``--light-rate`` its rate is set so that alone it keeps the
worker busy ``--light-load`` of the time (0.2: one light request is first timed alone, a few sent
one at a time), and each phase lasts long enough for ``--light-requests`` of them (at most
4 minutes). A fixed rate would be a light load on a fast machine and half of a slow one, where
under the flood a fair share (half) barely covers it and it queues behind itself.

Figures: light's TTFT p50 and p99 alone and under the flood, ``fairness_ttft_ratio`` (p99 under the
flood / p99 alone: 1 is perfect isolation), heavy's output tokens/s and completed requests, the
worker's preemptions, and the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from loadtest.arrivals import ArrivalKind, ArrivalSpec
from loadtest.client import RequestOptions, Target
from loadtest.failover_bench import metric, num_ready, scrape, wait_for
from loadtest.figures import fmt, ratio, rounded
from loadtest.launch import ROOT, Server, log_tail, running_server, stop_server
from loadtest.metrics import GroupSummary, summarize
from loadtest.prompt_text import load_tokenizer
from loadtest.record import machine
from loadtest.records import RequestRecord
from loadtest.runner import Bounds, RunResult, run_load
from loadtest.workloads import Api, Workload, WorkloadOptions, parse_range
from wire.config import ServerConfig

REAL_MODEL = "smollm2-135m-instruct"
READY_TIMEOUT_S = 300.0
TENANTS = {"heavy": "heavy-key", "light": "light-key"}  # tenant → its API key


@dataclass(frozen=True, slots=True)
class Defaults:
    """What differs between the mock and the real run; the flags fill in what is not given."""

    duration_s: float | None  # None: long enough for --light-requests at the light rate
    light_rate: float | None  # None: calibrated to --light-load of this worker
    heavy_concurrency: int
    max_num_seqs: int


MOCK = Defaults(duration_s=10.0, light_rate=4.0, heavy_concurrency=64, max_num_seqs=16)
REAL = Defaults(duration_s=None, light_rate=None, heavy_concurrency=32, max_num_seqs=8)
PROBE_REQUESTS = 6  # light requests sent one at a time to time one alone (the first one warms up)
MAX_DURATION_S = 240.0


def progress(message: str) -> None:
    print(f"[fairness] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench fairness", description=__doc__)
    parser.add_argument("--mock", action="store_true", help="a mock worker (a plumbing check, no model)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of light's load, per phase")
    parser.add_argument("--light-rate", type=float, default=None, help="light's Poisson rate, req/s")
    parser.add_argument(
        "--light-load",
        type=float,
        default=0.2,
        help="real, without --light-rate: light's rate is set so that alone it keeps the worker busy "
        "this fraction of the time (one light request timed alone first)",
    )
    parser.add_argument(
        "--light-requests",
        type=int,
        default=100,  # a p99 over ~100 requests, not the slowest of ~25 (it moved ±0.5 run to run)
        help="without --duration: light's requests per phase",
    )
    parser.add_argument("--light-prompt-len", type=parse_range, default=(32, 128), metavar="LO:HI")
    parser.add_argument("--light-output-len", type=parse_range, default=(16, 32), metavar="LO:HI")
    parser.add_argument("--heavy-concurrency", type=int, default=None, help="heavy's requests in flight")
    parser.add_argument("--heavy-prompt-len", type=parse_range, default=(32, 256), metavar="LO:HI")
    parser.add_argument("--heavy-output-len", type=parse_range, default=(32, 64), metavar="LO:HI")
    parser.add_argument("--flood-lead", type=float, default=5.0, help="s for the flood to fill the queue")
    parser.add_argument("--ordering", default="tiered", help="the worker's ordering policy (fcfs to compare)")
    parser.add_argument("--tier", default=None, help="both tenants' tier (default: the server's default)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="the worker's sequences at once")
    parser.add_argument("--threads", type=int, default=2, help="real: the worker's torch threads")
    parser.add_argument("--mock-step-ms", type=float, default=10.0, help="mock: fixed time per step")
    parser.add_argument("--mock-token-ms", type=float, default=0.02, help="mock: time per scheduled token")
    parser.add_argument("--timeout", type=float, default=300.0, help="client timeout per request, s")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    base = MOCK if args.mock else REAL
    for name, default in (
        ("duration", base.duration_s),
        ("light_rate", base.light_rate),
        ("heavy_concurrency", base.heavy_concurrency),
        ("max_num_seqs", base.max_num_seqs),
    ):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def run(args: argparse.Namespace) -> dict[str, object]:
    model = "mock" if args.mock else REAL_MODEL
    tokenizer = load_tokenizer("auto", model)
    light_options = WorkloadOptions(args.light_prompt_len, args.light_output_len)
    light_work = Workload("chat", tokenizer, Api.CHAT, args.seed, light_options)
    # The same lengths and arrivals under the flood, another text: no prefix hits from the first phase.
    light_flood_work = Workload(
        "chat", tokenizer, Api.CHAT, args.seed, dataclasses.replace(light_options, text_variant="/flood")
    )
    heavy_work = Workload(
        "chat",
        tokenizer,
        Api.CHAT,
        args.seed + 1,
        WorkloadOptions(args.heavy_prompt_len, args.heavy_output_len),
    )
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fairness-") as tmp, _fleet(Path(tmp), args) as (gw_a, gw_b):
        tier = args.tier or ServerConfig().default_tier
        light_target = Target("base", gw_b.base_url, model, tier)
        heavy_target = Target("base", gw_a.base_url, model, tier)
        if args.light_rate is None:
            probe_work = Workload(
                "chat",
                tokenizer,
                Api.CHAT,
                args.seed,
                dataclasses.replace(light_options, text_variant="/probe"),
            )
            service_s = asyncio.run(_service_time(light_target, probe_work, args))
            args.light_rate = calibrated_rate(args.light_load, service_s)
            progress(f"one light request alone takes {service_s:.2f} s: light at {args.light_rate:g} req/s")
        else:
            service_s = None
        if args.duration is None:
            args.duration = phase_duration(args.light_requests, args.light_rate)
        alone = _summary(asyncio.run(_light(light_target, light_work, args)).records)
        progress(f"alone: light TTFT p99 {fmt(alone.ttft_ms.p99)} ms over {alone.num_ok} requests")
        flood_light, heavy = asyncio.run(
            _flooded(light_target, heavy_target, light_flood_work, heavy_work, gw_b, args)
        )
        flood = _summary(flood_light.records)
        progress(f"flood: light TTFT p99 {fmt(flood.ttft_ms.p99)} ms over {flood.num_ok} requests")
        preemptions = int(metric(scrape(gw_b.base_url), "tierserve_worker_preemptions_total"))
    figures: dict[str, object] = {
        "scenario": "fairness",
        "model": model,
        "ordering": args.ordering,
        "tier": args.tier or ServerConfig().default_tier,
        "worker": (
            f"mock: {args.mock_step_ms:g} ms/step + {args.mock_token_ms:g} ms/scheduled token"
            if args.mock
            else f"{REAL_MODEL} (default-q4_1), {args.threads} thread(s)"
        )
        + f", max_num_seqs {args.max_num_seqs}",
        "light": (
            f"chat through gateway B: Poisson {args.light_rate:g} req/s for {args.duration:g} s, prompt "
            f"{_span(args.light_prompt_len)}, output {_span(args.light_output_len)} tokens, streamed"
        ),
        "heavy": (
            f"chat through gateway A: closed loop of {args.heavy_concurrency}, prompt "
            f"{_span(args.heavy_prompt_len)}, output {_span(args.heavy_output_len)} tokens"
        ),
        "light_rate": args.light_rate,
        # light's share of the worker's time alone: rate × one request's time alone (when timed)
        "light_load": None if service_s is None else round(args.light_rate * service_s, 3),
        "seed": args.seed,
        **fairness_figures(alone, flood, _summary(heavy.records)),
        "worker_preemptions": preemptions,
        "cpu": machine(),
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    return figures


def calibrated_rate(light_load: float, service_s: float) -> float:
    """Light's rate (req/s) for it to keep the worker busy ``light_load`` of the time alone, one of
    its requests taking ``service_s`` alone."""
    return round(light_load / service_s, 3)


def phase_duration(num_requests: int, rate: float) -> float:
    """Seconds for ``num_requests`` at ``rate`` on average, at most ``MAX_DURATION_S``."""
    return round(min(MAX_DURATION_S, num_requests / rate), 1)


def fairness_figures(alone: GroupSummary, flood: GroupSummary, heavy: GroupSummary) -> dict[str, object]:
    """Light's TTFT alone and under the flood, their ratio, and what the flood got done."""
    return {
        "light_completed_alone": alone.num_ok,
        "light_completed_flood": flood.num_ok,
        "light_failed": alone.num_requests - alone.num_ok + flood.num_requests - flood.num_ok,
        "light_ttft_p50_ms_alone": rounded(alone.ttft_ms.p50),
        "light_ttft_p50_ms_flood": rounded(flood.ttft_ms.p50),
        "light_ttft_p99_ms_alone": rounded(alone.ttft_ms.p99),
        "light_ttft_p99_ms_flood": rounded(flood.ttft_ms.p99),
        "fairness_ttft_ratio": ratio(flood.ttft_ms.p99, alone.ttft_ms.p99),
        "heavy_completed": heavy.num_ok,
        "heavy_output_tok_s": round(heavy.output_tok_s, 2),
    }


@contextmanager
def _fleet(tmp: Path, args: argparse.Namespace) -> Iterator[tuple[Server, Server]]:
    """Gateways A and B without workers of their own, and one worker dialling both."""
    addresses = [f"ipc://{tmp}/{name}.ipc" for name in "ab"]
    policies = json.dumps({"ordering": {"name": args.ordering, "params": {}}})
    command = [
        sys.executable, "-m", "worker.cli", "worker", "--worker-id", "fair-0",
        "--connect", addresses[0], "--connect", addresses[1],
        "--max-num-seqs", str(args.max_num_seqs), "--policies", policies,
    ]  # fmt: skip
    if args.mock:
        command += [
            "--mock",
            "--mock-step-ms",
            str(args.mock_step_ms),
            "--mock-token-ms",
            str(args.mock_token_ms),
        ]
    else:
        command += ["--served-name", REAL_MODEL, "--num-threads", str(args.threads)]
    worker_log = tmp / "worker.log"
    with ExitStack() as stack:
        with worker_log.open("wb") as log:
            worker = subprocess.Popen(
                command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        stack.callback(stop_server, worker)
        gateways = []
        try:
            for name, address in zip("ab", addresses, strict=True):
                config = tmp / f"{name}.toml"
                config.write_text(_gateway_config(address))
                serve_args = ["--no-workers", "--config", str(config)] + (
                    ["--mock", "1"] if args.mock else []
                )
                server = running_server(serve_args, tmp / f"{name}.log", READY_TIMEOUT_S)
                gateways.append(stack.enter_context(server))
            model = "mock" if args.mock else REAL_MODEL
            wait_for(
                lambda: all(num_ready(g.base_url, model) == 1 for g in gateways), READY_TIMEOUT_S, "worker"
            )
        except BaseException:
            progress(f"the worker's log ends with:\n{log_tail(worker_log)}")
            raise
        yield gateways[0], gateways[1]


def _gateway_config(worker_address: str) -> str:
    keys = "".join(f'\n[[tenants]]\nname = "{t}"\napi_keys = ["{key}"]\n' for t, key in TENANTS.items())
    # One salt key: a tenant's cached prefixes count on the worker whichever gateway it came through.
    return f'[gateway]\nworker_address = "{worker_address}"\ncache_salt_secret = "fairness"\n{keys}'


def _options(tenant: str, args: argparse.Namespace) -> RequestOptions:
    headers = {"Authorization": f"Bearer {TENANTS[tenant]}"}
    if args.tier is not None:
        headers["X-SLA-Tier"] = args.tier
    return RequestOptions(Api.CHAT, True, 0.0, True, headers, timeout_s=args.timeout)


async def _light(target: Target, workload: Workload, args: argparse.Namespace) -> RunResult:
    arrivals = ArrivalSpec(args.light_rate, ArrivalKind.POISSON)
    bounds = Bounds(None, args.duration, None)
    return await run_load([target], workload, arrivals, args.seed, bounds, _options("light", args))


async def _service_time(target: Target, workload: Workload, args: argparse.Namespace) -> float:
    """Seconds one light request takes alone: the mean latency of a few sent one at a time, the
    first (warm-up) left out."""
    bounds = Bounds(PROBE_REQUESTS, None, 1)
    result = await run_load(
        [target], workload, ArrivalSpec(None), args.seed + 2, bounds, _options("light", args)
    )
    records = sorted((r for r in result.records if r.is_ok), key=lambda r: r.t_sent)[1:]
    if not records:
        raise RuntimeError("no light request completed while timing one alone")
    return sum(r.t_end - r.t_sent for r in records) / len(records)


async def _flooded(
    light_target: Target,
    heavy_target: Target,
    light_work: Workload,
    heavy_work: Workload,
    gateway_b: Server,
    args: argparse.Namespace,
) -> tuple[RunResult, RunResult]:
    """Light's load once heavy's closed loop keeps requests waiting on the worker; both results."""
    bounds = Bounds(None, args.flood_lead + args.duration, args.heavy_concurrency)
    heavy = asyncio.create_task(
        run_load(
            [heavy_target], heavy_work, ArrivalSpec(None), args.seed + 1, bounds, _options("heavy", args)
        )
    )
    deadline = time.monotonic() + args.flood_lead
    while (
        metric(await asyncio.to_thread(scrape, gateway_b.base_url), "tierserve_worker_requests_waiting") < 1
    ):
        if time.monotonic() > deadline or heavy.done():
            heavy.cancel()
            raise RuntimeError(f"the flood left no request waiting on the worker within {args.flood_lead} s")
        await asyncio.sleep(0.1)  # the poll interval of a deadline-bounded wait
    light = await _light(light_target, light_work, args)
    return light, await heavy


def _summary(records: Sequence[RequestRecord]) -> GroupSummary:
    duration = max(r.t_end for r in records) - min(r.t_sent for r in records) if records else 0.0
    return summarize(records, {t.name: t for t in ServerConfig().tiers}, duration).overall


def _span(bounds: tuple[int, int]) -> str:
    return f"{bounds[0]}-{bounds[1]}"
