"""Phase summaries for the peers figures' tests: evenly timed requests, no server."""

from __future__ import annotations

from loadtest.metrics import GroupSummary, summarize
from loadtest.peers_figures import ServerResult
from loadtest.records import RequestRecord

TOKENS = 128


def group(seconds_per_request: float, num_requests: int, *, concurrent: bool = False) -> GroupSummary:
    """``num_requests`` of TOKENS tokens each, one after another (or all at once), evenly spaced."""
    records = []
    for i in range(num_requests):
        start = 0.0 if concurrent else i * seconds_per_request
        times = [start + 0.1 + k * (seconds_per_request - 0.1) / (TOKENS - 1) for k in range(TOKENS)]
        record = RequestRecord(i, "x", "standard", 40, TOKENS, t_sent=start, t_end=times[-1])
        record.chunk_times, record.num_output_tokens = times, TOKENS
        records.append(record)
    duration = max(r.t_end for r in records) - min(r.t_sent for r in records)
    return summarize(records, {}, duration).overall


def measured(name: str, single_s: float, burst_s: float) -> ServerResult:
    """One repetition of each phase."""
    single, burst = group(single_s, 4), group(burst_s, 32, concurrent=True)
    return ServerResult(name, "float32", None, 5.0, [single], [burst])
