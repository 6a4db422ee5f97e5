"""The policy harness's inputs and results (``tierserve/testing.py`` runs them on the real scheduler).

Inputs: the requests (:class:`SimRequest`, or :func:`poisson_workload`), the simulated engine
(:class:`SimConfig`: step ceilings, KV capacity, :class:`CostModel`). Results: what each request and
each tier experienced (:class:`RequestResult`, :class:`TierSummary`) and each step
(:class:`StepRecord`), in :class:`SimResult`. :class:`SimSeq` is a request as a policy sees it, for
calling a policy by hand. (An eviction policy's harness is ``tierserve/eviction_sim.py``.) Pure
Python: no torch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from policies.base import StepBudget
from wire.tier import Tier


class PolicyContractError(AssertionError):
    """A policy broke its kind's invariant (see ``policies.base``); the message says which and how."""


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class CostModel:
    """Simulated step time in ms: ``fixed + per_token · prefill tokens + per_decode · decodes +
    per_context_token · context`` (``per_decode_ms`` None: a decode costs ``per_token_ms`` too).

    ``context`` is the sum over scheduled requests of their context length after the step (what
    ``StepReport.num_context_tokens`` reports and ``worker.mock.MockCost`` charges). ``noise`` > 0
    multiplies each step by ``1 + N(0, noise)`` (floored at 0.1) from a generator seeded with ``seed``.
    """

    fixed_ms: float = 10.0
    per_token_ms: float = 0.5
    per_context_token_ms: float = 0.0005
    noise: float = 0.0
    seed: int = 0
    per_decode_ms: float | None = None

    def __post_init__(self) -> None:
        terms = (
            self.fixed_ms,
            self.per_token_ms,
            self.per_context_token_ms,
            self.noise,
            self.per_decode_ms or 0,
        )
        if min(terms) < 0:
            raise ValueError(f"cost terms must not be negative, got {self}")

    def mean_step_ms(self, num_tokens: int, num_context_tokens: int, num_decodes: int = 0) -> float:
        per_decode = self.per_token_ms if self.per_decode_ms is None else self.per_decode_ms
        return (
            self.fixed_ms
            + self.per_token_ms * (num_tokens - num_decodes)
            + per_decode * num_decodes
            + self.per_context_token_ms * num_context_tokens
        )


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The simulated engine: its step ceilings (``StepLimits``), KV capacity and cost model.

    ``kv_capacity_tokens`` None means the cache never fills (no preemption). ``block_size``: the KV
    cache's granularity; 1 (the default) counts it in tokens, 16 is what a worker runs. The prefix
    cache is off unless ``enable_prefix_caching`` (requests share no tokens, so it only lets a
    preempted request find its own blocks again). ``max_time_s`` bounds the simulated time; requests
    unfinished by then are reported unfinished.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    kv_capacity_tokens: int | None = None
    cost: CostModel = field(default_factory=CostModel)
    max_time_s: float = 3600.0
    block_size: int = 1
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens and max_num_seqs must be at least 1, got {self}")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be at least 1, got {self.kv_capacity_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One simulated request: when it arrives (seconds on the simulated clock), its tier (name, rank,
    TTFT and TPOT targets: ``wire.tier.Tier``), tenant, prompt length and how many tokens it generates."""

    request_id: str
    arrival_time: float
    tier: Tier
    num_prompt_tokens: int
    num_output_tokens: int
    tenant: str | None = None
    priority: int = 0  # within the tier, lower first

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1 or self.num_output_tokens < 1:
            raise ValueError(f"{self.request_id}: needs at least one prompt and one output token")


def poisson_workload(
    *,
    seed: int,
    rate_per_s: float,
    duration_s: float,
    mix: Sequence[tuple[Tier, float]],
    prompt_tokens: tuple[int, int] = (64, 512),
    output_tokens: tuple[int, int] = (16, 128),
    tenants: Sequence[str] = (),
) -> list[SimRequest]:
    """Poisson arrivals over ``duration_s``; each request's tier drawn by the ``mix`` weights, its
    lengths uniformly from the inclusive ranges, its tenant uniformly from ``tenants`` (None if empty).
    The same arguments always give the same requests."""
    rng = random.Random(seed)
    tiers = [tier for tier, _ in mix]
    weights = [weight for _, weight in mix]
    requests: list[SimRequest] = []
    now = rng.expovariate(rate_per_s)
    while now < duration_s:
        requests.append(
            SimRequest(
                request_id=f"r{len(requests)}",
                arrival_time=now,
                tier=rng.choices(tiers, weights)[0],
                num_prompt_tokens=rng.randint(*prompt_tokens),
                num_output_tokens=rng.randint(*output_tokens),
                tenant=rng.choice(tenants) if tenants else None,
            )
        )
        now += rng.expovariate(rate_per_s)
    return requests


# ---------------------------------------------------------------- the request a policy sees


class SimSeq:
    """A request as a worker policy sees it (``policies.base.SeqView``, read-only), made from a
    :class:`SimRequest`: for calling a policy by hand. The harness itself shows policies the
    scheduler's own requests."""

    __slots__ = ("_computed", "_spec")

    def __init__(self, spec: SimRequest, num_computed_tokens: int = 0) -> None:
        self._spec = spec
        self._computed = num_computed_tokens

    def __repr__(self) -> str:
        return (
            f"SimSeq({self.request_id!r}, tier={self.tier_name!r}, tenant={self.tenant!r}, "
            f"computed={self._computed}/{self.num_tokens})"
        )

    @property
    def request_id(self) -> str:
        return self._spec.request_id

    @property
    def tier_name(self) -> str:
        return self._spec.tier.name

    @property
    def tier_rank(self) -> int:
        return self._spec.tier.rank

    @property
    def tpot_ms(self) -> float | None:
        return self._spec.tier.tpot_ms

    @property
    def ttft_deadline(self) -> float | None:
        ttft_ms = self._spec.tier.ttft_ms
        return None if ttft_ms is None else self._spec.arrival_time + ttft_ms / 1e3

    @property
    def first_token_time(self) -> float | None:
        return None  # a request made by hand has produced nothing yet

    @property
    def tenant(self) -> str | None:
        return self._spec.tenant

    @property
    def priority(self) -> int:
        return self._spec.priority

    @property
    def arrival_time(self) -> float:
        return self._spec.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return self._spec.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return 0

    @property
    def num_tokens(self) -> int:
        return self._spec.num_prompt_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self._computed


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one request experienced, in simulated time. TPOT is vLLM's: (last − first token time) /
    (output tokens − 1); None with fewer than two tokens."""

    request_id: str
    tier: Tier
    tenant: str | None
    arrival_time: float
    token_times: tuple[float, ...]  # when each output token was emitted
    num_output_tokens: int  # asked for
    num_preemptions: int

    @property
    def finished(self) -> bool:
        return len(self.token_times) == self.num_output_tokens

    @property
    def finish_time(self) -> float | None:
        return self.token_times[-1] if self.finished else None

    @property
    def ttft_ms(self) -> float | None:
        return (self.token_times[0] - self.arrival_time) * 1e3 if self.token_times else None

    @property
    def tpot_ms(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) * 1e3 / (len(self.token_times) - 1)

    @property
    def max_itl_ms(self) -> float | None:
        """The longest gap between two consecutive tokens."""
        gaps = [b - a for a, b in pairwise(self.token_times)]
        return max(gaps) * 1e3 if gaps else None

    @property
    def meets_slo(self) -> bool:
        """Finished, with TTFT and TPOT within the tier's targets (a target of None always holds)."""
        if not self.finished:
            return False
        ttft, tpot = self.ttft_ms, self.tpot_ms
        if self.tier.ttft_ms is not None and ttft is not None and ttft > self.tier.ttft_ms:
            return False
        return not (self.tier.tpot_ms is not None and tpot is not None and tpot > self.tier.tpot_ms)


@dataclass(frozen=True, slots=True)
class TierSummary:
    """One tier over a run. Percentiles are nearest-rank over finished requests (None if none)."""

    name: str
    num_requests: int
    num_finished: int
    slo_attainment: float  # requests that met the SLO / all requests of the tier (unfinished miss)
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    num_preemptions: int
    num_output_tokens: int  # emitted


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One simulated step: when it started, its budget, what it held, how long it took."""

    start: float
    budget: StepBudget
    num_scheduled_tokens: dict[str, int]
    num_context_tokens: int
    elapsed_ms: float
    preempted: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SimResult:
    requests: dict[str, RequestResult]
    tiers: dict[str, TierSummary]
    steps: list[StepRecord]
    end_time: float

    @property
    def num_preemptions(self) -> int:
        return sum(r.num_preemptions for r in self.requests.values())

    @property
    def throughput_tok_s(self) -> float:
        emitted = sum(len(r.token_times) for r in self.requests.values())
        return emitted / self.end_time if self.end_time > 0 else 0.0


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(results: Iterable[RequestResult]) -> dict[str, TierSummary]:
    """Per-tier summaries of request results, keyed by tier name, most urgent tier first."""
    by_tier: dict[str, list[RequestResult]] = {}
    for r in sorted(results, key=lambda r: (r.tier.rank, r.tier.name)):
        by_tier.setdefault(r.tier.name, []).append(r)
    summaries: dict[str, TierSummary] = {}
    for name, rs in by_tier.items():
        done = [r for r in rs if r.finished]
        ttfts = [r.ttft_ms for r in done if r.ttft_ms is not None]
        tpots = [r.tpot_ms for r in done if r.tpot_ms is not None]
        summaries[name] = TierSummary(
            name=name,
            num_requests=len(rs),
            num_finished=len(done),
            slo_attainment=sum(r.meets_slo for r in rs) / len(rs),
            ttft_p50_ms=_percentile(ttfts, 50),
            ttft_p99_ms=_percentile(ttfts, 99),
            tpot_p50_ms=_percentile(tpots, 50),
            tpot_p99_ms=_percentile(tpots, 99),
            num_preemptions=sum(r.num_preemptions for r in rs),
            num_output_tokens=sum(len(r.token_times) for r in rs),
        )
    return summaries
