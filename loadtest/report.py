"""The result of a load run as JSON, as a Markdown summary, and the ratios of a ``--compare`` run.

The JSON holds the run's settings, every target's summary (overall and per tier) and timeline; the
Markdown is the table ``tierserve load`` prints, a row per tier.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.client import Target
from loadtest.metrics import GroupSummary, LatencyStats, RunSummary, Timeline
from loadtest.records import RequestRecord

# (name, how to read it off a summary, True when higher is better)
COMPARED: tuple[tuple[str, str, bool], ...] = (
    ("output_tok_s", "output_tok_s", True),
    ("request_s", "request_s", True),
    ("goodput_req_s", "goodput_req_s", True),
    ("ttft_p50_ms", "ttft_ms.p50", False),
    ("ttft_p99_ms", "ttft_ms.p99", False),
    ("tpot_p50_ms", "tpot_ms.p50", False),
    ("tpot_p99_ms", "tpot_ms.p99", False),
    ("itl_p50_ms", "itl_ms.p50", False),
    ("e2e_p50_ms", "e2e_ms.p50", False),
    ("e2e_p99_ms", "e2e_ms.p99", False),
)


@dataclass(frozen=True, slots=True)
class TargetResult:
    target: Target
    summary: RunSummary
    timeline: Timeline


def figure(summary: GroupSummary, path: str) -> float | None:
    value: object = summary
    for part in path.split("."):
        value = getattr(value, part)
    return value if isinstance(value, int | float) else None


def ratios(base: RunSummary, other: RunSummary) -> dict[str, float | None]:
    """other / base for each compared figure, overall (None where either side has no value)."""
    out: dict[str, float | None] = {}
    for name, path, _ in COMPARED:
        a, b = figure(base.overall, path), figure(other.overall, path)
        out[name] = round(b / a, 4) if a and b is not None else None
    return out


def result_json(
    settings: Mapping[str, object], results: Sequence[TargetResult], started_at: float
) -> dict[str, object]:
    body: dict[str, object] = {
        "tool": "tierserve load",
        "started_at": started_at,
        "settings": dict(settings),
        "targets": [
            {
                "label": r.target.label,
                "base_url": r.target.base_url,
                "model": r.target.model,
                "summary": dataclasses.asdict(r.summary),
                "timeline": dataclasses.asdict(r.timeline),
            }
            for r in results
        ],
    }
    if len(results) == 2:
        body["ratios"] = ratios(results[0].summary, results[1].summary)
    return body


def write_requests(path: Path, records: Sequence[RequestRecord]) -> None:
    """One JSON line per request, in send order per target (for anyone who wants other statistics)."""
    ordered = sorted(records, key=lambda r: (r.target, r.index))
    with path.open("w") as out:
        for r in ordered:
            row = dataclasses.asdict(r)
            row["outcome"] = r.outcome.value
            out.write(json.dumps(row) + "\n")


def _ms(stats: LatencyStats, *fields: str) -> str:
    values = [getattr(stats, f) for f in fields]
    return " / ".join("–" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in values)


def _slo(group: GroupSummary) -> str:
    if group.slo is None:
        return ""
    parts = []
    if group.slo.ttft_ms is not None:
        parts.append(f"TTFT≤{group.slo.ttft_ms:g}ms")
    if group.slo.tpot_ms is not None:
        parts.append(f"TPOT≤{group.slo.tpot_ms:g}ms")
    if group.slo.deadline_s is not None:
        parts.append(f"E2E≤{group.slo.deadline_s:g}s")
    return ", ".join(parts) or "none"


def _row(name: str, g: GroupSummary) -> str:
    failed = g.num_requests - g.num_ok
    attainment = "–" if g.slo_attainment is None else f"{g.slo_attainment:.1%}"
    return (
        f"| {name} | {g.num_requests} | {failed} | {_ms(g.ttft_ms, 'p50', 'p90', 'p99')} "
        f"| {_ms(g.tpot_ms, 'p50', 'p90', 'p99')} | {_ms(g.itl_ms, 'p50', 'p99')} "
        f"| {_ms(g.e2e_ms, 'p50', 'p99')} | {g.output_tok_s:.1f} | {_slo(g)} | {attainment} "
        f"| {g.goodput_req_s:.2f} |"
    )


def summary_table(summary: RunSummary) -> str:
    lines = [
        "| tier | requests | failed | TTFT ms p50/p90/p99 | TPOT ms p50/p90/p99 | ITL ms p50/p99 "
        "| E2E ms p50/p99 | out tok/s | SLO | attained | goodput req/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(name, group) for name, group in summary.tiers.items()]
    lines.append(_row("**all**", summary.overall))
    return "\n".join(lines)


def outcomes_line(group: GroupSummary) -> str:
    counts = ", ".join(f"{name} {n}" for name, n in group.outcomes.items() if n)
    cached = group.num_cached_tokens
    share = f" ({cached / group.num_prompt_tokens:.1%} of prompt tokens)" if group.num_prompt_tokens else ""
    return (
        f"outcomes: {counts or 'none'}; prompt tokens {group.num_prompt_tokens}, cached {cached}{share}, "
        f"output tokens {group.num_output_tokens}; total {group.total_tok_s:.1f} tok/s"
    )


def ratios_table(values: Mapping[str, float | None], base: str, other: str) -> str:
    lines = [f"| figure | {other} / {base} | better when |", "|---|---|---|"]
    for name, _, higher in COMPARED:
        value = values.get(name)
        lines.append(
            f"| {name} | {'–' if value is None else f'{value:.3f}'} | {'> 1' if higher else '< 1'} |"
        )
    return "\n".join(lines)


def markdown(settings: Mapping[str, object], results: Sequence[TargetResult]) -> str:
    described = ", ".join(f"{k} {v}" for k, v in settings.items() if v is not None)
    parts = ["# tierserve load", "", described, ""]
    for r in results:
        parts += [
            f"## {r.target.label}: {r.target.base_url} (model {r.target.model})",
            "",
            f"{r.summary.duration_s:.2f} s, {r.summary.overall.request_s:.2f} req/s completed",
            "",
            summary_table(r.summary),
            "",
            outcomes_line(r.summary.overall),
            "",
        ]
    if len(results) == 2:
        ratio_values = ratios(results[0].summary, results[1].summary)
        parts += [
            "## ratios",
            "",
            ratios_table(ratio_values, results[0].target.label, results[1].target.label),
            "",
        ]
    return "\n".join(parts)
