"""``tierserve load`` (also ``python -m loadtest``): drive an OpenAI-compatible server and report.

    tierserve load --base-url http://127.0.0.1:8000 --workload mixed-tiers --rate 4 --duration 30 \\
        --output-dir out/          # per-tier table on stdout; result.json, summary.md, PNGs in out/

See docs/loadtest.md for the workloads, the arrival processes and the metric definitions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import httpx

from loadtest.arrivals import ArrivalKind, ArrivalSpec
from loadtest.client import RequestOptions, Target
from loadtest.metrics import summarize, timeline
from loadtest.plots import write_plots
from loadtest.progress import Progress
from loadtest.prompt_text import load_tokenizer
from loadtest.records import RequestRecord
from loadtest.report import TargetResult, markdown, result_json, write_requests
from loadtest.runner import Bounds, planned_requests, run_load
from loadtest.workloads import WORKLOADS, Api, Workload, WorkloadOptions, parse_range
from wire.config import ConfigError, ServerConfig, load_config

DEFAULT_NUM_REQUESTS = 100
TIMELINE_BIN_S = 1.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierserve load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = p.add_argument_group("target")
    target.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    target.add_argument("--compare", metavar="URL2", help="a second server: the same workload, interleaved")
    target.add_argument("--model", help="the model to ask for (default: the server's first in /v1/models)")
    target.add_argument("--compare-model", help="the model on URL2 (default: its first in /v1/models)")
    target.add_argument("--api", choices=[a.value for a in Api], default="chat")
    target.add_argument("--no-stream", action="store_true", help="whole answers (TTFT = E2E, no TPOT/ITL)")
    target.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    target.add_argument(
        "-H",
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="an extra header (repeat)",
    )
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM extension)"
    )
    target.add_argument("--timeout", type=float, default=120.0, help="seconds per request, whole answer")
    target.add_argument(
        "--tiers-config",
        help="the server's TOML config: tier SLOs and default tier (default: built-in tiers)",
    )

    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="chat")
    work.add_argument("--dataset", type=Path, help="JSONL requests (with --workload dataset)")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--prompt-len", type=parse_range, metavar="LO[:HI]", help="prompt tokens (override)")
    work.add_argument("--output-len", type=parse_range, metavar="LO[:HI]", help="max_tokens (override)")
    work.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    work.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens per system prompt")
    work.add_argument(
        "--tokenizer", default="auto", help="'auto', 'bytes' (mock servers) or a Hugging Face model folder"
    )

    load = p.add_argument_group("arrivals and bounds")
    load.add_argument("--rate", type=float, help="requests/s (open loop); leave out for a closed loop")
    load.add_argument("--arrival", choices=[k.value for k in ArrivalKind], default="poisson")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    load.add_argument("--ramp-s", type=float, default=0.0, help="ramp the rate up over this many seconds")
    load.add_argument("--ramp-from", type=float, default=0.0, help="the ramp's starting rate, requests/s")
    load.add_argument("--concurrency", type=int, help="in-flight cap per server; alone, a closed loop")
    load.add_argument(
        "--num-requests", type=int, help=f"per server (default {DEFAULT_NUM_REQUESTS} if no --duration)"
    )
    load.add_argument("--duration", type=float, help="seconds during which requests are sent")

    out = p.add_argument_group("output")
    out.add_argument(
        "--output-dir",
        type=Path,
        help="result.json, summary.md, requests.jsonl, PNG plots (default: ./load-results/UTC-TIMESTAMP)",
    )
    out.add_argument("--no-output", action="store_true", help="write no files, only print")
    out.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    out.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (ValueError, FileNotFoundError, ConfigError, httpx.HTTPError) as exc:
        print(f"tierserve load: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.rate is None and args.concurrency is None:
        raise ValueError("give --rate (open loop) or --concurrency (closed loop), or both")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    bounds = Bounds(num_requests, args.duration, args.concurrency)
    arrivals = ArrivalSpec(
        args.rate, ArrivalKind(args.arrival), args.burstiness, ramp_s=args.ramp_s, ramp_from=args.ramp_from
    )
    config = load_config(args.tiers_config, env={}) if args.tiers_config else ServerConfig()
    headers = _headers(args.header, args.api_key)
    targets = [_target("base", args.base_url, args.model, headers, config)]
    if args.compare:
        targets.append(_target("compare", args.compare, args.compare_model, headers, config))
    api = Api(args.api)
    tokenizer = load_tokenizer(args.tokenizer, targets[0].model)
    options = WorkloadOptions(
        args.prompt_len, args.output_len, args.num_prefixes, args.prefix_len, args.dataset
    )
    workload = Workload(args.workload, tokenizer, api, args.seed, options)
    request_options = RequestOptions(
        api, not args.no_stream, args.temperature, args.ignore_eos, headers, args.timeout
    )
    progress = None if args.quiet else Progress(planned_requests(arrivals, args.seed, bounds), args.duration)
    _say(
        f"{args.workload} ({api.value}, tokenizer {tokenizer.name}), {arrivals.describe()}"
        + (f", concurrency {args.concurrency}" if args.concurrency else "")
        + " → "
        + " and ".join(f"{t.base_url} ({t.model})" for t in targets)
    )
    run = asyncio.run(run_load(targets, workload, arrivals, args.seed, bounds, request_options, progress))

    results = [_result(t, [r for r in run.records if r.target == t.label], config) for t in targets]
    settings = {
        "workload": args.workload,
        "api": api.value,
        "stream": not args.no_stream,
        "seed": args.seed,
        "arrivals": arrivals.describe(),
        "concurrency": args.concurrency,
        "num_requests": num_requests,
        "duration_s": args.duration,
        "tokenizer": tokenizer.name,
        "tiers": [t.name for t in config.tiers_by_urgency],
    }
    body = result_json(settings, results, run.started_at)
    text = markdown(settings, results)
    if not args.no_output:
        stamp = datetime.fromtimestamp(run.started_at, UTC).strftime("%Y%m%d-%H%M%S")
        out: Path = args.output_dir or Path("load-results") / stamp
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(body, indent=2) + "\n")
        (out / "summary.md").write_text(text)
        write_requests(out / "requests.jsonl", run.records)
        written = write_plots(out, results, run.records)
        _say(f"wrote {out / 'result.json'}, summary.md, requests.jsonl, {', '.join(p.name for p in written)}")
    print(json.dumps(body) if args.json else text)
    return 0


def _headers(raw: Sequence[str], api_key: str | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    for item in raw:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"-H {item!r}: expected 'Name: value'")
        headers[name.strip()] = value.strip()
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _target(
    label: str, base_url: str, model: str | None, headers: dict[str, str], config: ServerConfig
) -> Target:
    base_url = base_url.rstrip("/").removesuffix("/v1")
    if model is None:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0, trust_env=False)
        response.raise_for_status()
        served = [m["id"] for m in response.json().get("data", [])]
        if not served:
            raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
        model = str(served[0])
    return Target(label, base_url, model, config.default_tier)


def _result(target: Target, records: list[RequestRecord], config: ServerConfig) -> TargetResult:
    tiers = {t.name: t for t in config.tiers}
    duration = max((r.t_end for r in records), default=0.0) - min((r.t_sent for r in records), default=0.0)
    return TargetResult(target, summarize(records, tiers, duration), timeline(records, TIMELINE_BIN_S))


def _say(message: str) -> None:
    print(f"[load] {message}", file=sys.stderr, flush=True)
