"""What one request did, as the client saw it: the record every metric is computed from.

Times are ``time.perf_counter()`` seconds relative to the run's start, so records from one run (and from
both servers of a ``--compare`` run) share one clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Outcome(Enum):
    OK = "ok"
    HTTP_4XX = "http_4xx"  # a 4xx other than 429
    RATE_LIMITED = "http_429"
    HTTP_5XX = "http_5xx"
    TIMEOUT = "timeout"  # no answer, or no end of stream, within --timeout
    TRANSPORT_ERROR = "transport_error"  # connection refused or reset
    STREAM_ERROR = "stream_error"  # 200, then an error event or a stream that ended without finishing


@dataclass(slots=True)
class RequestRecord:
    index: int  # the workload's request index (the same request on both servers of a --compare run)
    target: str  # the server's label: "base" or "compare"
    tier: str  # echoed x-sla-tier, else the tier asked for, else the server config's default tier
    expected_prompt_tokens: int  # what the workload built, with the target's tokenizer
    max_tokens: int
    t_sent: float
    t_end: float = 0.0  # the last event received (the usage chunk included), or the failure
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk that carried text
    outcome: Outcome = Outcome.OK
    status: int | None = None  # HTTP status; None when no response arrived
    num_prompt_tokens: int | None = None  # from usage, when the server reports it
    num_output_tokens: int | None = None  # from usage; else the number of text chunks
    num_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    error: str = ""
    num_retries: int = 0  # sends after the first: a connection closed before any answer (client.send)

    @property
    def is_ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def t_first(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None
