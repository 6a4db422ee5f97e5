"""Unit-test a policy without a model or a GPU: the worker's own scheduler and KV cache manager, on a
simulated clock and cost model.

A policy author writes requests, runs them through ``worker.scheduler.Scheduler`` (the code a worker
runs) and asserts on what each request and each tier experienced::

    from tierserve.testing import SimConfig, SimRequest, simulate, poisson_workload
    from wire.tier import DEFAULT_TIERS

    interactive, _, batch = DEFAULT_TIERS
    requests = poisson_workload(seed=1, rate_per_s=20, duration_s=30, mix=[(interactive, 0.3), (batch, 0.7)])
    result = simulate(requests, ordering=MyOrdering(MyOrdering.Params()))
    assert result.tiers["interactive"].slo_attainment >= 0.9

Everything is deterministic: the clock only moves by the cost model's step times (seconds, starting at
0), and noise, when asked for, comes from a seeded generator. The run checks each policy's Protocol
invariants as it goes (an ordering returns a permutation, a budget stays within the limits, a victim is
one of the candidates) and raises :class:`PolicyContractError` naming the broken one.

One step, as a worker's engine takes it (``worker/engine.py``), the model replaced by the cost model::

    arrivals due by now are added to the scheduler (Scheduler.add)
    out = scheduler.schedule()          # the policies decide: see worker/scheduler.py
    the step takes cost.step_ms(new tokens, context after the step); the clock advances by that
    sampled = scheduler.postprocess(out)     # counters advance; who completed its tokens
    scheduler.report_step(out, elapsed)      # the budget policy observes the step
    each sampled request emits one token (its first: TTFT); one that emitted all its tokens finishes

Requests share no tokens, so with the prefix cache off (the default) a preempted request recomputes
its whole context; the KV cache is counted in tokens unless ``SimConfig.block_size`` says otherwise.
There is no gateway (no admission control, no shedding).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import ClassVar

from policies.base import (
    BudgetPolicy,
    EvictionPolicy,
    NoParams,
    OrderingPolicy,
    PreemptionPolicy,
    SeqView,
    SlotSharing,
    StepBudget,
    StepLimits,
    StepReport,
)
from policies.budget import Static
from policies.eviction import Lru
from policies.ordering import Fcfs
from policies.preemption import Newest
from tierserve.eviction_sim import EvictionSim
from tierserve.sim_types import (
    CostModel,
    PolicyContractError,
    RequestResult,
    SimConfig,
    SimRequest,
    SimResult,
    SimSeq,
    StepRecord,
    TierSummary,
    poisson_workload,
    summarize,
)
from wire.sampling import SamplingParams
from worker.kv_cache import KVCacheManager
from worker.policy_set import WorkerPolicies
from worker.request import FinishReason, Request, TierRef
from worker.scheduler import Scheduler, SchedulerConfig

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


def simulate(
    requests: Iterable[SimRequest],
    *,
    ordering: OrderingPolicy | None = None,
    budget: BudgetPolicy | None = None,
    preemption: PreemptionPolicy | None = None,
    eviction: EvictionPolicy | None = None,
    config: SimConfig | None = None,
) -> SimResult:
    """Run ``requests`` to completion (or ``config.max_time_s``) through the worker's scheduler under
    the given policies; the baselines (``fcfs``, ``static``, ``newest``, ``lru``) stand in for any not
    given. See the module docstring for a step."""
    policies = WorkerPolicies(
        ordering or Fcfs(NoParams()),
        budget or Static(NoParams()),
        preemption or Newest(NoParams()),
        eviction or Lru(NoParams()),
    )
    return _Harness(list(requests), policies, config or SimConfig()).run()


class _Harness:
    def __init__(self, specs: list[SimRequest], policies: WorkerPolicies, config: SimConfig) -> None:
        ids = [s.request_id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        capacity = config.kv_capacity_tokens
        for s in specs:
            if capacity is not None and s.num_prompt_tokens + s.num_output_tokens > capacity:
                # As the worker refuses it: such a request could never run even alone.
                raise ValueError(f"{s.request_id} needs more KV than the whole cache ({capacity} tokens)")
        self.specs = sorted(specs, key=lambda s: s.arrival_time)
        self.config = config
        bs = config.block_size
        if capacity is None:  # room for every request at once, whole: the cache never fills
            num_blocks = sum(-(-(s.num_prompt_tokens + s.num_output_tokens) // bs) for s in specs) + 1
        else:
            num_blocks = capacity // bs
        kv_cache = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, policies.eviction)
        self.budget = _CheckedBudget(policies.budget)
        checked = WorkerPolicies(
            _CheckedOrdering(policies.ordering),
            self.budget,
            _CheckedPreemption(policies.preemption),
            policies.eviction,
        )
        limits = SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs)
        self.scheduler = Scheduler(limits, kv_cache, checked, clock=lambda: self.now)
        self.rng = random.Random(config.cost.seed)
        self.now = 0.0
        self.next_arrival = 0  # index into self.specs
        self.token_times: dict[str, list[float]] = {s.request_id: [] for s in specs}
        self.requests: dict[str, Request] = {}
        self.steps: list[StepRecord] = []

    def run(self) -> SimResult:
        num_unfinished = len(self.specs)
        while num_unfinished and self.now < self.config.max_time_s:
            self._arrive()
            if not self.scheduler.num_unfinished:
                self.now = max(self.now, self.specs[self.next_arrival].arrival_time)
                continue
            num_unfinished -= self._step()
        results = {
            s.request_id: RequestResult(
                request_id=s.request_id,
                tier=s.tier,
                tenant=s.tenant,
                arrival_time=s.arrival_time,
                token_times=tuple(self.token_times[s.request_id]),
                num_output_tokens=s.num_output_tokens,
                num_preemptions=self.requests[s.request_id].num_preemptions
                if s.request_id in self.requests
                else 0,
            )
            for s in self.specs
        }
        return SimResult(results, summarize(results.values()), self.steps, self.now)

    def _arrive(self) -> None:
        while self.next_arrival < len(self.specs) and self.specs[self.next_arrival].arrival_time <= self.now:
            spec = self.specs[self.next_arrival]
            tier = spec.tier
            request = Request(
                spec.request_id,
                [0] * spec.num_prompt_tokens,
                SamplingParams(max_tokens=spec.num_output_tokens, ignore_eos=True),
                tier=TierRef(tier.name, tier.rank, tier.ttft_ms, tier.tpot_ms),
                tenant=spec.tenant,
                priority=spec.priority,
                arrival_time=spec.arrival_time,
            )
            self.scheduler.add(request)
            self.requests[spec.request_id] = request
            self.next_arrival += 1

    def _step(self) -> int:
        """One step; returns how many requests finished in it."""
        out = self.scheduler.schedule()
        if out.is_empty and not out.preempted:
            raise RuntimeError(
                f"the scheduler stalled at t={self.now:.3f}s: nothing scheduled with "
                f"{len(self.scheduler.running)} running and {len(self.scheduler.waiting)} waiting "
                f"({self.scheduler.kv_cache.num_free_blocks} KV blocks free)"
            )
        num_tokens = out.total_num_tokens
        context = sum(r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] for r in out.scheduled)
        cost = self.config.cost
        num_decodes = sum(n == 1 for n in out.num_scheduled_tokens.values())
        elapsed_ms = cost.mean_step_ms(num_tokens, context, num_decodes)
        if cost.noise > 0:
            elapsed_ms *= max(0.1, 1.0 + self.rng.gauss(0.0, cost.noise))
        if out.is_empty:
            # Only when every running request was preempted: the next step admits them.
            elapsed_ms = 0.0
        preempted = tuple(r.request_id for r in out.preempted)
        assert self.budget.last is not None
        self.steps.append(
            StepRecord(
                self.now, self.budget.last, dict(out.num_scheduled_tokens), context, elapsed_ms, preempted
            )
        )
        self.now += elapsed_ms / 1e3
        sampled = self.scheduler.postprocess(out)
        if not out.is_empty:
            self.scheduler.report_step(out, elapsed_ms)
        num_finished = 0
        for request in sampled:
            request.append_output_token(0)
            self.token_times[request.request_id].append(self.now)
            if request.num_output_tokens == request.sampling_params.max_tokens:
                self.scheduler.finish(request.request_id, FinishReason.LENGTH)
                num_finished += 1
        return num_finished


# ---------------------------------------------------------------- the policies, their contracts checked


class _CheckedOrdering:
    kind: ClassVar[str] = "ordering"

    def __init__(self, policy: OrderingPolicy) -> None:
        self.policy = policy

    def order(self, requests: Sequence[SeqView], now: float) -> list[SeqView]:
        ordered = self.policy.order(tuple(requests), now)
        if len(ordered) != len(requests) or {id(s) for s in ordered} != {id(s) for s in requests}:
            raise PolicyContractError(
                f"{type(self.policy).__name__}.order did not return a permutation of its {len(requests)} "
                f"requests (got {len(ordered)}: {[getattr(s, 'request_id', s) for s in ordered]})"
            )
        return list(ordered)

    def slot_donors(
        self, request: SeqView, running: Sequence[SeqView], waiting: Sequence[SeqView], max_num_seqs: int
    ) -> list[SeqView]:
        if not isinstance(self.policy, SlotSharing):
            return []
        donors = self.policy.slot_donors(request, tuple(running), tuple(waiting), max_num_seqs)
        if any(d is request or not any(d is r for r in running) for d in donors):
            named = [getattr(d, "request_id", d) for d in donors]
            raise PolicyContractError(
                f"{type(self.policy).__name__}.slot_donors named {named} for {request.request_id}: "
                "not all of them running requests other than it"
            )
        return list(donors)


class _CheckedBudget:
    kind: ClassVar[str] = "budget"

    def __init__(self, policy: BudgetPolicy) -> None:
        self.policy = policy
        self.last: StepBudget | None = None  # what the latest step was given

    def budget(
        self, running: Sequence[SeqView], waiting: Sequence[SeqView], limits: StepLimits
    ) -> StepBudget:
        budget = self.policy.budget(tuple(running), tuple(waiting), limits)
        if not (
            1 <= budget.max_num_tokens <= limits.max_num_batched_tokens
            and 1 <= budget.max_num_seqs <= limits.max_num_seqs
        ):
            raise PolicyContractError(
                f"{type(self.policy).__name__}.budget returned {budget}, outside 1..{limits}"
            )
        self.last = budget
        return budget

    def observe(self, report: StepReport) -> None:
        self.policy.observe(report)


class _CheckedPreemption:
    kind: ClassVar[str] = "preemption"

    def __init__(self, policy: PreemptionPolicy) -> None:
        self.policy = policy

    def victim(self, candidates: Sequence[SeqView]) -> SeqView:
        chosen = self.policy.victim(tuple(candidates))
        if not any(c is chosen for c in candidates):
            raise PolicyContractError(
                f"{type(self.policy).__name__}.victim returned {chosen!r}, not one of its "
                f"{len(candidates)} candidates"
            )
        return chosen
