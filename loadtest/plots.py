"""PNG plots of a load run (matplotlib, Agg backend: no display needed).

latency_cdf.png   CDFs of TTFT, TPOT and E2E latency, a line per tier (and per server in --compare)
timeline.png      output tokens/s and requests in flight over the run
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loadtest.metrics import e2e_s, tpot_s, ttft_s
from loadtest.records import RequestRecord
from loadtest.report import TargetResult

PANELS = (("TTFT", ttft_s), ("TPOT", tpot_s), ("E2E latency", e2e_s))


def write_plots(
    out_dir: Path, results: Sequence[TargetResult], records: Sequence[RequestRecord]
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [out_dir / "latency_cdf.png", out_dir / "timeline.png"]
    many = len(results) > 1

    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.5))
    for ax, (title, measure) in zip(axes, PANELS, strict=True):
        for r in results:
            label = r.target.label
            for tier in r.summary.tiers:
                values = sorted(
                    v * 1e3
                    for rec in records
                    if rec.is_ok and rec.target == label and rec.tier == tier
                    for v in [measure(rec)]
                    if v is not None
                )
                if values:
                    cdf = [(i + 1) / len(values) for i in range(len(values))]
                    ax.step(values, cdf, where="post", label=f"{label}: {tier}" if many else tier)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, (tok_ax, flight_ax) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for r in results:
        t = r.timeline
        tok_ax.step(t.starts, t.output_tok_s, where="post", label=r.target.label)
        flight_ax.step(t.starts, t.in_flight, where="post", label=r.target.label)
    tok_ax.set_ylabel("output tokens/s")
    flight_ax.set_ylabel("requests in flight")
    flight_ax.set_xlabel("seconds since start")
    for ax in (tok_ax, flight_ax):
        ax.grid(alpha=0.3)
        if many:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths
