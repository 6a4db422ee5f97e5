"""The ``load-smoke`` scenario: ``tierserve load``'s machinery against ``tierserve serve --mock N``.

    tierserve bench load-smoke --json

Starts serve with N mock workers on 127.0.0.1 (each step sleeps ``MOCK_STEP_MS``), sends a seeded
mixed-tiers workload as a Poisson process, and reports the per-tier figures plus one ratio measured in
the run: the median TPOT over the mock's step time, the per-token cost of everything around the engine
(gateway, ZeroMQ, SSE, the client) on this machine, since a mock step costs no compute.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

from loadtest.arrivals import ArrivalKind, ArrivalSpec
from loadtest.client import RequestOptions, Target
from loadtest.figures import rounded
from loadtest.launch import log_tail, running_server
from loadtest.metrics import summarize
from loadtest.prompt_text import load_tokenizer
from loadtest.runner import Bounds, run_load
from loadtest.workloads import Api, Workload, WorkloadOptions
from wire.config import ServerConfig

MOCK_STEP_MS = 5.0  # what `worker --mock` sleeps per step unless told otherwise (worker/cli.py)
READY_TIMEOUT_S = 120.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench load-smoke", description=__doc__)
    parser.add_argument("--mock", type=int, default=2, metavar="N", help="mock workers")
    parser.add_argument("--rate", type=float, default=16.0, help="requests/s, Poisson")
    parser.add_argument("--num-requests", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, object]:
    config = ServerConfig()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="load-smoke-") as tmp:
        log_path = Path(tmp) / "serve.log"
        try:
            with running_server(["--mock", str(args.mock)], log_path, READY_TIMEOUT_S) as server:
                target = Target("base", server.base_url, "mock", config.default_tier)
                workload = Workload(
                    "mixed-tiers", load_tokenizer("bytes", "mock"), Api.CHAT, args.seed, WorkloadOptions()
                )
                options = RequestOptions(Api.CHAT, True, 0.0, False, {}, timeout_s=120.0)
                arrivals = ArrivalSpec(args.rate, ArrivalKind.POISSON)
                bounds = Bounds(args.num_requests, None, None)
                result = asyncio.run(run_load([target], workload, arrivals, args.seed, bounds, options))
        except BaseException:
            print(f"[load-smoke] the server's log ends with:\n{log_tail(log_path)}", file=sys.stderr)
            raise
    records = result.records
    duration = max(r.t_end for r in records) - min(r.t_sent for r in records)
    summary = summarize(records, {t.name: t for t in config.tiers}, duration)
    overall = summary.overall
    tpot_p50 = overall.tpot_ms.p50
    return {
        "scenario": "load-smoke",
        "mock_workers": args.mock,
        "mock_step_ms": MOCK_STEP_MS,
        "workload": "mixed-tiers",
        "arrivals": arrivals.describe(),
        "num_requests": args.num_requests,
        "completed": overall.num_ok,
        "failed": overall.num_requests - overall.num_ok,
        "prompt_tokens_as_built": sum(r.num_prompt_tokens == r.expected_prompt_tokens for r in records),
        "duration_s": round(duration, 3),
        "request_s": round(overall.request_s, 3),
        "output_tok_s": round(overall.output_tok_s, 2),
        "ttft_p50_ms": rounded(overall.ttft_ms.p50),
        "ttft_p99_ms": rounded(overall.ttft_ms.p99),
        "tpot_p50_ms": rounded(tpot_p50),
        "tpot_p99_ms": rounded(overall.tpot_ms.p99),
        "itl_p50_ms": rounded(overall.itl_ms.p50),
        "tpot_over_step_ratio": rounded(tpot_p50 / MOCK_STEP_MS if tpot_p50 is not None else None),
        "slo_attainment": {name: rounded(g.slo_attainment) for name, g in summary.tiers.items()},
        "goodput_req_s": round(overall.goodput_req_s, 3),
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
