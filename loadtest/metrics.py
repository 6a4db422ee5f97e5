"""Latency and throughput figures from request records, with vLLM's benchmark definitions.

    TTFT  time to first token: the first chunk that carries text, from the send
    TPOT  time per output token, the first excluded: (t_end - t_first) / (n - 1), n the output tokens
          (undefined for n = 1: left out of TPOT figures, and such a request meets any TPOT target)
    ITL   inter-token latency: the gaps between successive text chunks, pooled over all requests
    E2E   end-to-end latency: t_end - t_sent, t_end the stream's last event (the usage chunk included)
Percentiles interpolate linearly between order statistics (numpy's default, as vLLM uses).
Throughput divides by the run's duration: first send to last completion, as vLLM does.
A tier's SLO attainment is the share of its requests that succeeded and met every target of the tier
(TTFT, TPOT, deadline; a tier without targets only needs success); goodput is those requests per second.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from loadtest.records import Outcome, RequestRecord
from wire.tier import Tier


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ttft_s(record: RequestRecord) -> float | None:
    return None if record.t_first is None else record.t_first - record.t_sent


def tpot_s(record: RequestRecord) -> float | None:
    n = record.num_output_tokens
    if record.t_first is None or n is None or n < 2:
        return None
    return (record.t_end - record.t_first) / (n - 1)


def itls_s(record: RequestRecord) -> list[float]:
    times = record.chunk_times
    return [b - a for a, b in itertools.pairwise(times)]


def e2e_s(record: RequestRecord) -> float:
    return record.t_end - record.t_sent


def meets_slo(record: RequestRecord, tier: Tier | None) -> bool:
    """Succeeded, and within every target the tier sets (no tier: success is enough)."""
    if not record.is_ok:
        return False
    if tier is None:
        return True
    ttft, tpot = ttft_s(record), tpot_s(record)
    if tier.ttft_ms is not None and (ttft is None or ttft * 1e3 > tier.ttft_ms):
        return False
    if tier.tpot_ms is not None and tpot is not None and tpot * 1e3 > tier.tpot_ms:
        return False
    return tier.deadline_s is None or e2e_s(record) <= tier.deadline_s


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Milliseconds; None when there were no samples."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> LatencyStats:
        if not values:
            return cls(0, None, None, None, None)
        ms = [v * 1e3 for v in values]
        return cls(len(ms), sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_ms: float | None
    tpot_ms: float | None
    deadline_s: float | None

    @classmethod
    def of(cls, tier: Tier | None) -> SLO:
        return cls(None, None, None) if tier is None else cls(tier.ttft_ms, tier.tpot_ms, tier.deadline_s)


@dataclass(frozen=True, slots=True)
class GroupSummary:
    """One group of requests: all of a run, or one tier."""

    num_requests: int
    num_ok: int
    outcomes: dict[str, int]  # Outcome value → count, every outcome listed
    num_retried: int  # sent twice: the server closed the connection before answering (client.send)
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    request_s: float
    output_tok_s: float
    total_tok_s: float
    slo: SLO | None  # None for the overall group: each request is judged by its own tier
    num_slo_met: int
    slo_attainment: float | None  # None when the group has no requests
    goodput_req_s: float


@dataclass(frozen=True, slots=True)
class RunSummary:
    duration_s: float
    overall: GroupSummary
    tiers: dict[str, GroupSummary]  # most urgent first when the tiers are known


def summarize(records: Sequence[RequestRecord], tiers: Mapping[str, Tier], duration_s: float) -> RunSummary:
    """Figures for the whole run and per tier; ``tiers`` maps a name to its targets."""
    names = sorted({r.tier for r in records}, key=lambda n: (tiers[n].rank if n in tiers else 1 << 30, n))
    per_tier = {
        name: _group([r for r in records if r.tier == name], tiers, duration_s, tiers.get(name))
        for name in names
    }
    return RunSummary(duration_s, _group(records, tiers, duration_s, None), per_tier)


def _group(
    records: Sequence[RequestRecord], tiers: Mapping[str, Tier], duration_s: float, tier: Tier | None
) -> GroupSummary:
    ok = [r for r in records if r.is_ok]
    outcomes = {o.value: 0 for o in Outcome}
    for r in records:
        outcomes[r.outcome.value] += 1
    prompt = sum(r.num_prompt_tokens or 0 for r in ok)
    output = sum(r.num_output_tokens or 0 for r in ok)
    met = sum(meets_slo(r, tiers.get(r.tier)) for r in records)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return GroupSummary(
        num_requests=len(records),
        num_ok=len(ok),
        outcomes=outcomes,
        num_retried=sum(r.num_retries > 0 for r in records),
        ttft_ms=LatencyStats.of_seconds(_present(ttft_s(r) for r in ok)),
        tpot_ms=LatencyStats.of_seconds(_present(tpot_s(r) for r in ok)),
        itl_ms=LatencyStats.of_seconds([gap for r in ok for gap in itls_s(r)]),
        e2e_ms=LatencyStats.of_seconds([e2e_s(r) for r in ok]),
        num_prompt_tokens=prompt,
        num_output_tokens=output,
        num_cached_tokens=sum(r.num_cached_tokens or 0 for r in ok),
        request_s=len(ok) * per_s,
        output_tok_s=output * per_s,
        total_tok_s=(prompt + output) * per_s,
        slo=SLO.of(tier) if tier is not None else None,
        num_slo_met=met,
        slo_attainment=met / len(records) if records else None,
        goodput_req_s=met * per_s,
    )


def _present(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


@dataclass(frozen=True, slots=True)
class Timeline:
    """Per bin of ``bin_s`` seconds from the start: output tokens/s, and requests in flight at mid-bin."""

    bin_s: float
    starts: list[float]
    output_tok_s: list[float]
    in_flight: list[int]


def timeline(records: Sequence[RequestRecord], bin_s: float = 1.0) -> Timeline:
    """A request's output tokens are spread evenly over its text chunks (a chunk may carry several)."""
    end = max((r.t_end for r in records), default=0.0)
    num_bins = max(1, math.ceil(end / bin_s))
    tokens = [0.0] * num_bins
    for r in records:
        if r.chunk_times and r.num_output_tokens:
            per_chunk = r.num_output_tokens / len(r.chunk_times)
            for t in r.chunk_times:
                tokens[min(int(t / bin_s), num_bins - 1)] += per_chunk
    starts = [i * bin_s for i in range(num_bins)]
    in_flight = [sum(r.t_sent <= s + bin_s / 2 < r.t_end for r in records) for s in starts]
    return Timeline(bin_s, starts, [t / bin_s for t in tokens], in_flight)
