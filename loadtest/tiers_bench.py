"""The ``tiers`` scenario: first come first served vs the default (tiered) config, under overload, in one run.

    tierserve bench tiers --json [--duration 90] [--probe-s 30]

One worker of the embedded model (``--mock`` swaps in mock workers: plumbing only, a mock step costs
no compute), in the default dtype. The ``interactive-batch`` workload (30% interactive: TTFT 1 s,
TPOT 100 ms; 70% batch, sheddable) as a seeded Poisson process:

  1. saturation: probes of ``--probe-s`` seconds at rising rates against serve with the ``fcfs`` set;
     the saturation rate is the highest probed rate at which fcfs keeps interactive TPOT p99 within
     the tier's target (the lowest probe rate if none does; the JSON says which);
  2. the same seeded workload at ``--load-factor`` (2) × saturation for ``--duration`` seconds, once
     against a fresh server with the fcfs set and once with the default config (no policy named:
     what a new user gets), then the default config again at twice that load (4×); every request is
     waited for (client timeout ``--timeout``), so a request that is neither finished nor shed counts.

Figures: interactive SLO attainment (TTFT and TPOT within target) in each run, output tokens/s and
the ratio default ÷ fcfs at 2×, per-tier TTFT and TPOT p99, the fraction of batch requests shed, and
the fraction that completed or were shed fast (429 within ``FAST_SHED_S``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.arrivals import ArrivalKind, ArrivalSpec
from loadtest.client import RequestOptions, Target
from loadtest.figures import fmt, rounded
from loadtest.launch import Server, log_tail, running_server
from loadtest.metrics import RunSummary, percentile, summarize, tpot_s
from loadtest.policy_sets import POLICY_SETS
from loadtest.prompt_text import load_tokenizer
from loadtest.records import Outcome, RequestRecord
from loadtest.runner import Bounds, run_load
from loadtest.workloads import Api, Workload, WorkloadOptions
from wire.config import ServerConfig

WORKLOAD = "interactive-batch"
FAST_SHED_S = 2.0
READY_TIMEOUT_S = 600.0
RUNS = (("fcfs", "fcfs", 1.0), ("tiered", "tiered", 1.0), ("tiered_4x", "tiered", 2.0))  # name, set, × load


def progress(message: str) -> None:
    print(f"[tiers] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench tiers", description=__doc__)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of load per policy set")
    parser.add_argument("--probe-s", type=float, default=30.0, help="seconds per saturation probe")
    parser.add_argument("--probe-rates", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0, 1.5, 2.0])
    parser.add_argument("--load-factor", type=float, default=2.0, help="times the saturation rate")
    parser.add_argument("--timeout", type=float, default=900.0, help="client timeout per request, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mock", action="store_true", help="mock workers (a plumbing check, no model)")
    return parser.parse_args(argv)


@dataclass(frozen=True, slots=True)
class SetResult:
    summary: RunSummary
    records: list[RequestRecord]

    def interactive_tpot_p99_ms(self) -> float | None:
        values = [t * 1e3 for r in self.records if r.tier == "interactive" and (t := tpot_s(r)) is not None]
        return percentile(values, 99) if values else None


def run(args: argparse.Namespace) -> dict[str, object]:
    config = ServerConfig()
    tiers = {t.name: t for t in config.tiers}
    target_tpot = tiers["interactive"].tpot_ms
    assert target_tpot is not None
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tiers-") as tmp:
        workdir = Path(tmp)
        # 1. saturation under fcfs
        saturation, probes = None, []
        with _server(workdir, "fcfs", args, "probe") as server:
            for i, rate in enumerate(args.probe_rates):
                result = _load(server, args, rate, args.probe_s, seed=args.seed + 1000 + i, config=config)
                p99 = result.interactive_tpot_p99_ms()
                ok = p99 is not None and p99 <= target_tpot
                probes.append({"rate": rate, "interactive_tpot_p99_ms": rounded(p99), "within": ok})
                progress(
                    f"probe {rate:g} req/s: interactive TPOT p99 {fmt(p99)} ms → {'ok' if ok else 'over'}"
                )
                if not ok:
                    break
                saturation = rate
        found = saturation is not None
        base_rate = saturation if saturation is not None else args.probe_rates[0]
        rate = base_rate * args.load_factor
        progress(
            f"saturation {base_rate:g} req/s ({'found' if found else 'none passed'}); load {rate:g} req/s"
        )
        # 2. the same workload under each set, then the default config at twice the load
        results: dict[str, SetResult] = {}
        for name, set_name, factor in RUNS:
            with _server(workdir, set_name, args, name) as server:
                results[name] = _load(
                    server, args, rate * factor, args.duration, seed=args.seed, config=config
                )
            tok_s = results[name].summary.overall.output_tok_s
            progress(f"{name}: {tok_s:.1f} tok/s, interactive attainment {fmt(_attainment(results[name]))}")
    fcfs, tiered = results["fcfs"], results["tiered"]
    throughput = {name: r.summary.overall.output_tok_s for name, r in results.items()}
    figures: dict[str, object] = {
        "scenario": "tiers",
        "model": "mock" if args.mock else "smollm2-135m-instruct",
        "config": "the default config (tiered) vs fcfs",
        "workload": WORKLOAD,
        "saturation_rate": base_rate,
        "saturation_found": found,
        "probes": probes,
        "rate": rate,
        "rate_4x": rate * 2,
        "duration_s": args.duration,
        "num_requests": len(tiered.records),
        "interactive_attainment_fcfs": rounded(_attainment(fcfs)),
        "interactive_attainment_tiered": rounded(_attainment(tiered)),
        "interactive_attainment_tiered_4x": rounded(_attainment(results["tiered_4x"])),
        "interactive_tpot_p99_ms_fcfs": rounded(fcfs.interactive_tpot_p99_ms()),
        "interactive_tpot_p99_ms_tiered": rounded(tiered.interactive_tpot_p99_ms()),
        "throughput_tok_s_fcfs": round(throughput["fcfs"], 2),
        "throughput_tok_s_tiered": round(throughput["tiered"], 2),
        "throughput_tok_s_tiered_4x": round(throughput["tiered_4x"], 2),
        "throughput_ratio": rounded(
            throughput["tiered"] / throughput["fcfs"] if throughput["fcfs"] else None
        ),
        "batch_shed_fraction": rounded(batch_shed_fraction(tiered.records)),
        "batch_shed_fraction_4x": rounded(batch_shed_fraction(results["tiered_4x"].records)),
        "interactive_shed_4x": _num_shed(results["tiered_4x"].records, "interactive"),
        "batch_completed_or_shed_fraction": rounded(batch_completed_or_shed(tiered.records)),
        "batch_completed_or_shed_fraction_fcfs": rounded(batch_completed_or_shed(fcfs.records)),
        "batch_shed_tiered": _num_shed(tiered.records, "batch"),
        "per_tier": {name: _per_tier(result) for name, result in results.items()},
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    return figures


def batch_shed_fraction(records: Sequence[RequestRecord]) -> float | None:
    batch = [r for r in records if r.tier == "batch"]
    return _num_shed(records, "batch") / len(batch) if batch else None


def _per_tier(result: SetResult) -> dict[str, dict[str, float | None]]:
    """TTFT and TPOT p99 (ms) and SLO attainment of each tier in one run."""
    return {
        name: {
            "ttft_p99_ms": rounded(group.ttft_ms.p99),
            "tpot_p99_ms": rounded(group.tpot_ms.p99),
            "slo_attainment": rounded(group.slo_attainment),
            "num_requests": group.num_requests,
        }
        for name, group in result.summary.tiers.items()
    }


def batch_completed_or_shed(records: Sequence[RequestRecord]) -> float | None:
    """Batch requests that finished, or were refused with a 429 within FAST_SHED_S, over all batch."""
    batch = [r for r in records if r.tier == "batch"]
    if not batch:
        return None
    good = sum(
        r.is_ok or (r.outcome is Outcome.RATE_LIMITED and r.t_end - r.t_sent <= FAST_SHED_S) for r in batch
    )
    return good / len(batch)


def _num_shed(records: Sequence[RequestRecord], tier: str) -> int:
    return sum(r.tier == tier and r.outcome is Outcome.RATE_LIMITED for r in records)


def _attainment(result: SetResult) -> float | None:
    group = result.summary.tiers.get("interactive")
    return group.slo_attainment if group is not None else None


class _server:
    """``running_server`` with one policy set's config written next to its log."""

    def __init__(self, workdir: Path, set_name: str, args: argparse.Namespace, label: str) -> None:
        self.config_path = workdir / f"{label}.toml"
        self.config_path.write_text(POLICY_SETS[set_name])
        self.log_path = workdir / f"{label}.log"
        worker = ["--mock", "1"] if args.mock else []
        self._context = running_server(
            [*worker, "--config", str(self.config_path)], self.log_path, READY_TIMEOUT_S
        )

    def __enter__(self) -> Server:
        return self._context.__enter__()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            progress(f"the server's log ends with:\n{log_tail(self.log_path)}")
        self._context.__exit__(*exc)  # type: ignore[arg-type]


def _load(
    server: Server,
    args: argparse.Namespace,
    rate: float,
    duration_s: float,
    *,
    seed: int,
    config: ServerConfig,
) -> SetResult:
    model = "mock" if args.mock else "smollm2-135m-instruct"
    target = Target("base", server.base_url, model, config.default_tier)
    tokenizer = load_tokenizer("bytes" if args.mock else "auto", model)
    workload = Workload(WORKLOAD, tokenizer, Api.CHAT, seed, WorkloadOptions())
    options = RequestOptions(Api.CHAT, True, 0.0, False, {}, timeout_s=args.timeout)
    arrivals = ArrivalSpec(rate, ArrivalKind.POISSON)
    result = asyncio.run(
        run_load([target], workload, arrivals, seed, Bounds(None, duration_s, None), options)
    )
    records = result.records
    duration = max(r.t_end for r in records) - min(r.t_sent for r in records) if records else 0.0
    return SetResult(summarize(records, {t.name: t for t in config.tiers}, duration), records)
