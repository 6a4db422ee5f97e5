"""The ``peers`` scenario's figures: what each server did, its figures, and ours ÷ theirs.

Single stream and concurrent run ``--repeats`` times against each server (each repetition its own
prompt texts, the same lengths, so no run reuses another's cached prefix). A server's figure is its
median repetition by output tok/s (of an even count the lower middle), every repetition's tok/s listed
beside it: on a shared VM one disturbed repetition no longer decides a ratio (on a 2-core Xeon VM one
single-stream phase of six ran 22% below the others, in a recorded run). A repetition with a failed
request is no comparison (``usable``); the ok counts add up every repetition's requests.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loadtest import peers_install
from loadtest.metrics import GroupSummary, RunSummary
from loadtest.peers_servers import MODEL, Precision, cores
from loadtest.policy_sets import DEFAULT_SET
from loadtest.record import machine
from wire.config import DEFAULT_MODEL_PATH
from worker.cpu_isa import CpuCaps, IsaLevel

OURS = "tierserve"
PEERS = ("vllm", "llamacpp")
PHASES = ("single", "concurrent")
RATIO_DIGITS = 3


@dataclass(slots=True)
class ServerResult:
    """What one server did; a peer that failed has ``error`` and no figures."""

    name: str
    dtype: str | None = None
    error: str | None = None
    start_s: float | None = None  # from launch to its health endpoint answering 200
    single: list[GroupSummary] = field(default_factory=list)  # one per repetition
    concurrent: list[GroupSummary] = field(default_factory=list)  # one per repetition
    # What the machine gave it (loadtest.machine_state): the hypervisor's share of the CPU time during
    # each repetition, % (None: unread), and the read bandwidth before it started and after it stopped.
    single_steal: list[float | None] = field(default_factory=list)
    concurrent_steal: list[float | None] = field(default_factory=list)
    read_gb_s_around: tuple[float, float] | None = None
    mixed: RunSummary | None = None
    check: GroupSummary | None = None
    note: str | None = None  # how it ran, where that differs from the recipe (docs/benchmarks.md)
    isa: str | None = None  # what it ran, as seen once it started (peers_bench.isa_of)

    def phase(self, name: str) -> list[GroupSummary]:
        return self.single if name == "single" else self.concurrent

    def steal(self, name: str) -> list[float | None]:
        return self.single_steal if name == "single" else self.concurrent_steal

    def add(self, name: str, run: GroupSummary, steal_pct: float | None) -> None:
        """One repetition of phase ``name``."""
        self.phase(name).append(run)
        self.steal(name).append(steal_pct)


def usable(group: GroupSummary) -> bool:
    """A repetition counts only when every request of it succeeded: a partial run is no comparison."""
    return group.num_requests > 0 and group.num_ok == group.num_requests


def median_run(runs: Sequence[GroupSummary]) -> GroupSummary | None:
    """The usable repetition at the median output tok/s (the lower middle of an even count); None
    when none is usable."""
    ranked = sorted((g for g in runs if usable(g)), key=lambda g: g.output_tok_s)
    return ranked[(len(ranked) - 1) // 2] if ranked else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours ÷ theirs, rounded; None when either is missing (or theirs is zero)."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return round(ours / theirs, RATIO_DIGITS)


def server_figures(result: ServerResult) -> dict[str, object]:
    """One server's figures; a failed or skipped phase gives nulls."""
    out: dict[str, object] = {"dtype": result.dtype, "start_s": result.start_s, "isa": result.isa}
    if result.note is not None:
        out["note"] = result.note
    if result.error is not None:
        out["error"] = result.error
    chosen = {label: median_run(result.phase(label)) for label in PHASES}
    single, concurrent = chosen["single"], chosen["concurrent"]
    out["single_tok_s"] = _round(single.output_tok_s if single else None)
    out["single_tpot_ms"] = _round(single.tpot_ms.p50 if single else None)
    out["single_ttft_ms"] = _round(single.ttft_ms.p50 if single else None)
    out["concurrent_tok_s"] = _round(concurrent.output_tok_s if concurrent else None)
    out["concurrent_tpot_p50_ms"] = _round(concurrent.tpot_ms.p50 if concurrent else None)
    out["concurrent_ttft_p50_ms"] = _round(concurrent.ttft_ms.p50 if concurrent else None)
    out["concurrent_req_s"] = _round(concurrent.request_s if concurrent else None)
    for label in PHASES:
        runs = result.phase(label)
        if not runs:
            continue
        out[f"{label}_ok"] = f"{sum(g.num_ok for g in runs)}/{sum(g.num_requests for g in runs)}"
        median = chosen[label]
        out[f"{label}_output_tokens"] = median.num_output_tokens if median else None
        out[f"{label}_tok_s_runs"] = [_round(g.output_tok_s) if usable(g) else None for g in runs]
        stolen = result.steal(label)
        if any(pct is not None for pct in stolen):
            out[f"{label}_steal_pct_runs"] = stolen
        retried = sum(g.num_retried for g in runs)
        if retried:
            out[f"{label}_retried"] = retried
    if result.read_gb_s_around is not None:
        out["read_gb_s_around"] = list(result.read_gb_s_around)
    if result.mixed is not None:
        out["mixed_output_tok_s"] = _round(result.mixed.overall.output_tok_s)
        out["mixed_tiers"] = {name: _tier_figures(g) for name, g in result.mixed.tiers.items()}
        if result.mixed.overall.num_retried:
            out["mixed_retried"] = result.mixed.overall.num_retried
    return out


def scenario_name(
    precision: Precision,
    tierserve_path: str,
    caps: CpuCaps,
    policies: str = DEFAULT_SET,
    threads: int | None = None,
) -> str:
    """The docs block a run records into: peers (or peers-fp32) when tierserve serves its default
    pool path, -float when it serves the float folder ("default"), -gguf another GGUF file, -folder
    another folder. A CPU below AVX-512 adds its class (-avx2, -generic), so that its run records
    beside an AVX-512 one, not over it; so does TIERSERVE_CPU_ISA, with -capped: every server is held
    to that level (peers_isa), a stand-in for a CPU of that class; so does --threads (-threads-N), fewer
    threads than cores. A policy set other than the defaults ends the name (-fcfs)."""
    name = "peers" if precision is Precision.BEST else "peers-fp32"
    if tierserve_path == "default":
        name += "-float"
    elif tierserve_path != DEFAULT_MODEL_PATH:
        name += "-gguf" if tierserve_path.endswith(".gguf") else "-folder"
    if caps.level < IsaLevel.AVX512:
        name += "-avx2" if caps.level == IsaLevel.AVX2 else "-generic"
    name += "-capped" if caps.is_overridden else ""
    name += f"-threads-{threads}" if threads is not None else ""
    return name if policies == DEFAULT_SET else f"{name}-{policies}"


def figures(
    args: argparse.Namespace, results: Mapping[str, ServerResult], rate: float | None, caps: CpuCaps
) -> dict[str, object]:
    precision = Precision(args.precision)
    threads = args.threads or cores()
    fewer = threads if threads < cores() else None
    out: dict[str, object] = {
        # --record's block
        "scenario": scenario_name(precision, args.tierserve_path, caps, args.tierserve_policies, fewer),
        "model": MODEL,
        "precision": precision.value,
        "tierserve_path": args.tierserve_path,  # its pool's path: default-q4_1 (the GGUF), default (float)
        "tierserve_policies": args.tierserve_policies,  # its worker policy set (loadtest.policy_sets)
        "cpu": machine(),
        "threads": threads,  # each server's (--threads), else one a core
        "workload": (
            f"streamed chat, greedy, ignore_eos, {args.output_tokens} output tokens each; single: "
            f"1 warm-up + {args.num_single} one at a time; concurrent: {args.concurrency} at once; "
            f"each {args.repeats}x, the median run; mixed-tiers: Poisson at {args.load_factor:g}x "
            f"the slowest's capacity for {args.mixed_s:g} s"
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
        for figure in PHASES:
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
            "isa": result.isa,
            "error": result.error,
            "answered": check is not None and check.num_ok == 1,
            "output_tokens": check.num_output_tokens if check is not None else None,
            "ttft_ms": _round(check.ttft_ms.p50) if check is not None else None,
        }
        if result.note is not None:
            entry["note"] = result.note
        out[name] = entry
    return out


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
