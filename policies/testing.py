"""Unit-test a policy without a model or a GPU: a simulated clock, engine cost model and scheduler.

A policy author writes requests, runs them through the same rules the worker's scheduler follows, and
asserts on what each request and each tier experienced::

    from policies.testing import SimConfig, SimRequest, simulate, poisson_workload
    from wire.tier import DEFAULT_TIERS

    interactive, _, batch = DEFAULT_TIERS
    requests = poisson_workload(seed=1, rate_per_s=20, duration_s=30, mix=[(interactive, 0.3), (batch, 0.7)])
    result = simulate(requests, ordering=MyOrdering(MyOrdering.Params()))
    assert result.tiers["interactive"].slo_attainment >= 0.9

Everything is deterministic: the clock only moves by the cost model's step times (seconds, starting at
0), and noise, when asked for, comes from a seeded generator. The run checks each policy's Protocol
invariants as it goes (an ordering returns a permutation, a budget stays within the limits, a victim is
one of the candidates) and raises :class:`PolicyContractError` naming the broken one.

The simulated scheduler, step by step (the rules of ``worker/scheduler.py``)::

    arrivals due by now join the waiting queue
    budget = budget_policy.budget(running, waiting, limits)             # a StepBudget
    for each request in ordering.order(running + waiting, now), while tokens and sequences last:
        running: it gets min(its remaining tokens, tokens left) new tokens (its next prefill chunk,
            or 1 for a decode). No room in the KV cache: preemption.victim(every running request,
            this one included) gives its KV back and waits, to be recomputed from scratch (tokens it
            was given this step return to the budget); if the victim is this request, it waits.
        waiting: skipped once anyone was preempted this step, or while the engine's max_num_seqs
            requests run; otherwise admitted with min(its tokens, tokens left), unless the KV cache
            cannot hold them: then no later waiting request is admitted this step (running ones
            later in the order are still served: they are what frees the cache).
    the step takes cost.step_ms(new tokens, context after the step); the clock advances by that;
    budget_policy.observe(StepReport(...)); a request whose computed tokens reach its length emits
    one token (its first one: TTFT); one that has emitted all its tokens finishes.

Under ``fcfs`` running requests come before waiting ones (they arrived first), so that is "running
first"; under ``tiered`` a waiting interactive request goes before running batch decodes.

Simplifications: the KV cache is counted in tokens (no blocks, no prefix cache, so a preempted request
recomputes its whole context); there is no gateway (no admission control, no shedding).

For eviction, :class:`EvictionSim` keeps one LRU list of free cached blocks per tier, as the worker's
block pool does, and asks the policy which tier's oldest block to reuse.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from policies.base import (
    BudgetPolicy,
    EvictionCandidate,
    EvictionPolicy,
    NoParams,
    OrderingPolicy,
    PreemptionPolicy,
    StepBudget,
    StepLimits,
    StepReport,
)
from policies.budget import Static
from policies.ordering import Fcfs
from policies.preemption import Newest
from wire.tier import Tier

__all__ = [
    "CostModel",
    "EvictionSim",
    "PolicyContractError",
    "RequestResult",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "SimSeq",
    "StepRecord",
    "TierSummary",
    "poisson_workload",
    "simulate",
    "summarize",
]


class PolicyContractError(AssertionError):
    """A policy broke its kind's invariant (see ``policies.base``); the message says which and how."""


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class CostModel:
    """Simulated step time in ms: ``fixed + per_token · new tokens + per_context_token · context``.

    ``context`` is the sum over scheduled requests of their context length after the step (what
    ``StepReport.num_context_tokens`` reports and ``worker.mock.MockCost`` charges). ``noise`` > 0
    multiplies each step by ``1 + N(0, noise)`` (floored at 0.1) from a generator seeded with ``seed``.
    """

    fixed_ms: float = 10.0
    per_token_ms: float = 0.5
    per_context_token_ms: float = 0.0005
    noise: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.fixed_ms, self.per_token_ms, self.per_context_token_ms, self.noise) < 0:
            raise ValueError(f"cost terms must not be negative, got {self}")

    def mean_step_ms(self, num_tokens: int, num_context_tokens: int) -> float:
        return self.fixed_ms + self.per_token_ms * num_tokens + self.per_context_token_ms * num_context_tokens


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The simulated engine: its step ceilings (``StepLimits``), KV capacity and cost model.

    ``kv_capacity_tokens`` None means the cache never fills (no preemption). ``max_time_s`` bounds the
    simulated time; requests unfinished by then are reported unfinished.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    kv_capacity_tokens: int | None = None
    cost: CostModel = field(default_factory=CostModel)
    max_time_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens and max_num_seqs must be at least 1, got {self}")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be at least 1, got {self.kv_capacity_tokens}")

    @property
    def limits(self) -> StepLimits:
        return StepLimits(self.max_num_batched_tokens, self.max_num_seqs)


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
    """A simulated request as a worker policy sees it: satisfies ``policies.base.SeqView`` (read-only)."""

    __slots__ = (
        "_computed",
        "_emitted",
        "_kv_tokens",
        "_preemptions",
        "_running",
        "_spec",
        "_token_times",
    )

    def __init__(self, spec: SimRequest) -> None:
        self._spec = spec
        self._computed = 0
        self._emitted = 0
        self._kv_tokens = 0  # KV slots held: computed tokens plus those allocated for this step
        self._preemptions = 0
        self._running = False
        self._token_times: list[float] = []

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
    def tenant(self) -> str | None:
        return self._spec.tenant

    @property
    def arrival_time(self) -> float:
        return self._spec.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return self._spec.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self._emitted

    @property
    def num_tokens(self) -> int:
        return self._spec.num_prompt_tokens + self._emitted

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


# ---------------------------------------------------------------- the simulated scheduler


def simulate(
    requests: Iterable[SimRequest],
    *,
    ordering: OrderingPolicy | None = None,
    budget: BudgetPolicy | None = None,
    preemption: PreemptionPolicy | None = None,
    config: SimConfig | None = None,
) -> SimResult:
    """Run ``requests`` to completion (or ``config.max_time_s``) under the given policies; the
    baselines (``fcfs``, ``static``, ``newest``) stand in for any not given. See the module docstring
    for the rules."""
    return _Simulation(
        list(requests),
        ordering or Fcfs(NoParams()),
        budget or Static(NoParams()),
        preemption or Newest(NoParams()),
        config or SimConfig(),
    ).run()


class _Simulation:
    def __init__(
        self,
        specs: list[SimRequest],
        ordering: OrderingPolicy,
        budget: BudgetPolicy,
        preemption: PreemptionPolicy,
        config: SimConfig,
    ) -> None:
        ids = [s.request_id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        capacity = config.kv_capacity_tokens
        for s in specs:
            if capacity is not None and s.num_prompt_tokens + s.num_output_tokens > capacity:
                # As the worker refuses it: such a request could never run even alone.
                raise ValueError(f"{s.request_id} needs more KV than the whole cache ({capacity} tokens)")
        self.seqs = [SimSeq(s) for s in sorted(specs, key=lambda s: s.arrival_time)]
        self.ordering, self.budget, self.preemption, self.config = ordering, budget, preemption, config
        self.rng = random.Random(config.cost.seed)
        self.now = 0.0
        self.kv_used = 0
        self.next_arrival = 0  # index into self.seqs
        self.waiting: list[SimSeq] = []
        self.running: list[SimSeq] = []
        self.steps: list[StepRecord] = []

    def run(self) -> SimResult:
        num_unfinished = len(self.seqs)
        while num_unfinished and self.now < self.config.max_time_s:
            self._arrive()
            if not self.running and not self.waiting:
                self.now = max(self.now, self.seqs[self.next_arrival].arrival_time)
                continue
            num_unfinished -= self._step()
        results = {
            s.request_id: RequestResult(
                request_id=s.request_id,
                tier=s._spec.tier,
                tenant=s.tenant,
                arrival_time=s.arrival_time,
                token_times=tuple(s._token_times),
                num_output_tokens=s._spec.num_output_tokens,
                num_preemptions=s._preemptions,
            )
            for s in self.seqs
        }
        return SimResult(results, summarize(results.values()), self.steps, self.now)

    def _arrive(self) -> None:
        while self.next_arrival < len(self.seqs) and self.seqs[self.next_arrival].arrival_time <= self.now:
            self.waiting.append(self.seqs[self.next_arrival])
            self.next_arrival += 1

    def _fits(self, num_new: int) -> bool:
        capacity = self.config.kv_capacity_tokens
        return capacity is None or self.kv_used + num_new <= capacity

    def _allocate(self, seq: SimSeq, num_new: int) -> None:
        need = seq._computed + num_new - seq._kv_tokens
        self.kv_used += max(0, need)
        seq._kv_tokens = max(seq._kv_tokens, seq._computed + num_new)

    def _free(self, seq: SimSeq) -> None:
        self.kv_used -= seq._kv_tokens
        seq._kv_tokens = 0

    def _step(self) -> int:
        """One step; returns how many requests finished in it."""
        limits = self.config.limits
        step_budget = self.budget.budget(tuple(self.running), tuple(self.waiting), limits)
        _check_budget(self.budget, step_budget, limits)
        tokens_left = step_budget.max_num_tokens
        scheduled: dict[str, int] = {}
        preempted: list[SimSeq] = []
        admitting = True  # until a waiting request finds the cache full
        for seq in _checked_order(self.ordering, [*self.running, *self.waiting], self.now):
            if tokens_left <= 0 or len(scheduled) >= step_budget.max_num_seqs:
                break
            if seq._running:
                tokens_left -= self._serve_running(seq, tokens_left, scheduled, preempted)
            elif admitting and not preempted:  # a preemption means the cache is full: admit nobody
                if len(self.running) >= limits.max_num_seqs:
                    continue  # no sequence slot; a running request later in the order may still go
                num_new = min(seq.num_tokens - seq._computed, tokens_left)
                if not self._fits(num_new):
                    # Nobody later in the order is admitted (they would overtake it), but running
                    # requests still are: they are what frees the cache.
                    admitting = False
                    continue
                self._allocate(seq, num_new)
                seq._running = True
                self.waiting.remove(seq)
                self.running.append(seq)
                scheduled[seq.request_id] = num_new
                tokens_left -= num_new
        if not scheduled and not preempted:
            raise RuntimeError(
                f"the simulated scheduler stalled at t={self.now:.3f}s: nothing scheduled with "
                f"{len(self.running)} running and {len(self.waiting)} waiting ({self.kv_used} KV tokens used)"
            )
        served = [s for s in self.running if s.request_id in scheduled]
        return self._run_step(step_budget, served, scheduled, preempted)

    def _serve_running(
        self, seq: SimSeq, tokens_left: int, scheduled: dict[str, int], preempted: list[SimSeq]
    ) -> int:
        """Give a running request its next tokens, preempting until they fit; the budget used (net of
        what victims already scheduled this step give back)."""
        num_new = min(seq.num_tokens - seq._computed, tokens_left)
        returned = 0
        while not self._fits(num_new):
            candidates = list(self.running)
            chosen = self.preemption.victim(tuple(candidates))
            victim = next((c for c in candidates if c is chosen), None)
            if victim is None:
                raise PolicyContractError(
                    f"{type(self.preemption).__name__}.victim returned {chosen!r}, not one of its "
                    f"{len(candidates)} candidates"
                )
            self._preempt(victim, preempted)
            returned += scheduled.pop(victim.request_id, 0)
            if victim is seq:
                return -returned
        self._allocate(seq, num_new)
        scheduled[seq.request_id] = num_new
        return num_new - returned

    def _preempt(self, seq: SimSeq, preempted: list[SimSeq]) -> None:
        self._free(seq)
        seq._running = False
        seq._computed = 0
        seq._preemptions += 1
        self.running.remove(seq)
        self.waiting.insert(0, seq)
        preempted.append(seq)

    def _run_step(
        self,
        step_budget: StepBudget,
        served: list[SimSeq],
        scheduled: dict[str, int],
        preempted: list[SimSeq],
    ) -> int:
        num_tokens = sum(scheduled.values())
        context = sum(s._computed + scheduled[s.request_id] for s in served)
        cost = self.config.cost
        elapsed_ms = cost.mean_step_ms(num_tokens, context)
        if cost.noise > 0:
            elapsed_ms *= max(0.1, 1.0 + self.rng.gauss(0.0, cost.noise))
        if not served:
            # Only possible when every running request was preempted: the next step admits them.
            elapsed_ms = 0.0
        self.steps.append(
            StepRecord(
                self.now, step_budget, scheduled, context, elapsed_ms, tuple(s.request_id for s in preempted)
            )
        )
        self.now += elapsed_ms / 1e3
        if served:
            self.budget.observe(StepReport(num_tokens, len(served), context, elapsed_ms))
        num_finished = 0
        for seq in served:
            seq._computed += scheduled[seq.request_id]
            if seq._computed == seq.num_tokens:
                seq._emitted += 1
                seq._token_times.append(self.now)
                if seq._emitted == seq._spec.num_output_tokens:
                    self._free(seq)
                    seq._running = False
                    self.running.remove(seq)
                    num_finished += 1
        return num_finished


def _checked_order(policy: OrderingPolicy, seqs: Sequence[SimSeq], now: float) -> list[SimSeq]:
    ordered = policy.order(tuple(seqs), now)
    if len(ordered) != len(seqs) or {id(s) for s in ordered} != {id(s) for s in seqs}:
        raise PolicyContractError(
            f"{type(policy).__name__}.order did not return a permutation of its {len(seqs)} requests "
            f"(got {len(ordered)}: {[getattr(s, 'request_id', s) for s in ordered]})"
        )
    by_id = {id(s): s for s in seqs}
    return [by_id[id(s)] for s in ordered]


def _check_budget(policy: BudgetPolicy, budget: StepBudget, limits: StepLimits) -> None:
    if not (
        1 <= budget.max_num_tokens <= limits.max_num_batched_tokens
        and 1 <= budget.max_num_seqs <= limits.max_num_seqs
    ):
        raise PolicyContractError(f"{type(policy).__name__}.budget returned {budget}, outside 1..{limits}")


# ---------------------------------------------------------------- eviction


class EvictionSim:
    """Free cached blocks, one LRU list per tier, as the worker's block pool keeps them.

    Feed it events: ``free(block, tier_rank, at)`` when a block's last user finishes (it stays cached),
    ``reuse(block)`` when a prefix hit takes it back out of the free lists. ``evict(now)`` shows the
    policy the oldest free block of each tier (``EvictionCandidate``, tiers most urgent first), removes
    the one it picks and returns its id; :class:`PolicyContractError` if the index is out of range.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._free: dict[int, list[tuple[float, int, Hashable]]] = {}  # rank → [(last_used, seq, block)]
        self._where: dict[Hashable, tuple[int, tuple[float, int, Hashable]]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._where)

    def free(self, block: Hashable, tier_rank: int, at: float) -> None:
        if block in self._where:
            raise ValueError(f"block {block!r} is already free")
        entry = (at, self._seq, block)
        self._seq += 1
        bisect.insort(self._free.setdefault(tier_rank, []), entry)
        self._where[block] = (tier_rank, entry)

    def reuse(self, block: Hashable) -> None:
        rank, entry = self._where.pop(block)
        self._free[rank].remove(entry)

    def candidates(self) -> list[tuple[EvictionCandidate, Hashable]]:
        """The oldest free block of each tier that has one, most urgent tier first."""
        return [
            (EvictionCandidate(rank, blocks[0][0]), blocks[0][2])
            for rank, blocks in sorted(self._free.items())
            if blocks
        ]

    def evict(self, now: float) -> Hashable:
        shown = self.candidates()
        if not shown:
            raise ValueError("no free block to evict")
        index = self.policy.choose([c for c, _ in shown], now)
        if not (isinstance(index, int) and 0 <= index < len(shown)):
            raise PolicyContractError(
                f"{type(self.policy).__name__}.choose returned {index!r} for {len(shown)} candidates"
            )
        block = shown[index][1]
        self.reuse(block)
        return block
