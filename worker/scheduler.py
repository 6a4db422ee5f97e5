"""One scheduling model for prefill and decode, steered by the worker's policies.

Every request has ``num_computed_tokens`` and ``num_tokens``; a step gives some requests
``num_new_tokens`` each under a token budget, so a long prompt is prefilled in chunks while
other requests keep decoding in the same step. Each step:

  1. the budget policy sizes the step (tokens, sequences, and optionally a ceiling on its predicted
     time), never above the configured ceilings;
  2. the ordering policy orders running and waiting requests together; in that order a running
     request gets its next tokens (its decode, or its next prefill chunk) and a waiting one is
     admitted (prefix hits first) while blocks and budget last; requests that do not fit wait, a
     running one keeping its KV. Under a time limit a decode that would overrun it sits the step
     out and a prefill chunk is shortened to fit (never below ``MIN_CHUNK_TOKENS`` unless that is
     all it has left); the step's first request always runs (its prefill chunk cut to the limit
     too, to no less than ``MIN_CHUNK_TOKENS``); a request whose first token is due may go on to
     its own ceiling (``StepTimeLimit.first_token_ms``), and once it is in the step so may everyone
     after it; before it, everyone stays within ``max_ms``;
  3. when a running request needs a block and none is free, the preemption policy picks a victim
     among the running (possibly the request itself): its blocks are freed (full ones stay cached)
     and it is recomputed later; once anyone was preempted, nobody else is admitted this step;
  4. when every sequence slot is taken or the blocks run out, a waiting request may take the slot
     or the blocks of running requests of less urgent tiers, the preemption policy choosing each
     victim (or that the request waits); with every slot held by its own tier, an ordering with
     slot sharing (``policies.base.SlotSharing``: ``tiered``, between tenants) names the running
     requests it may take a slot from, and the preemption policy picks one.

Under ``fcfs`` running requests arrived before waiting ones (but for the preempted), so this is
"running first"; under ``tiered`` a waiting interactive request goes before running batch decodes,
which is how the budget goes to the urgent tier first. Pure Python: no torch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from policies.base import SlotSharing, StepLimits, StepReport
from policies.step_time import MIN_CHUNK_TOKENS, StepTimeLimit
from worker.kv_cache import KVCacheManager
from worker.policy_set import WorkerPolicies
from worker.prompt_logprobs import ScoreSpan, score_spans
from worker.request import SCORE_CHUNK_TOKENS, FinishReason, Request, RequestStatus


@dataclass(slots=True)
class _StepClock:
    """The predicted time of the step being built, against the budget's limit (None: no limit, every
    request fits). Time charged for a request that is later preempted in the same step is not given
    back (the step only gets shorter).

    Everyone's tokens fit within ``open_ms``: the limit's ``max_ms``, raised to a due first token's
    own ceiling (``limit.first_token_ms``) once that request is in the step. So the longer step is
    not spent before the request it is for, and what it leaves is anyone's after it."""

    limit: StepTimeLimit | None
    spent_ms: float = 0.0
    open_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.limit is not None:
            self.spent_ms = self.limit.cost.fixed_ms
            self.open_ms = self.limit.max_ms

    def allowed(self, request_id: str, num_new: int, context_before: int, is_first: bool) -> int:
        """How many of ``num_new`` tokens after ``context_before`` fit (0: sit this step out)."""
        if self.limit is None:
            return num_new
        ceiling = max(self.open_ms, self.limit.first_token_ms.get(request_id, 0.0))
        cost, room = self.limit.cost, ceiling - self.spent_ms
        if num_new == 1:
            return 1 if is_first or cost.decode_ms(context_before + 1) <= room else 0
        num_fit = min(num_new, cost.chunk_tokens_within(room, context_before))
        least = min(num_new, MIN_CHUNK_TOKENS)
        if is_first:  # it runs, but a prefill chunk is still cut to the limit
            return max(num_fit, least)
        return num_fit if num_fit >= least else 0

    def charge(self, request_id: str, num_new: int, context_before: int) -> None:
        if self.limit is None:
            return
        cost = self.limit.cost
        if num_new == 1:
            self.spent_ms += cost.decode_ms(context_before + 1)
        else:
            self.spent_ms += cost.chunk_ms(num_new, context_before)
        self.open_ms = max(self.open_ms, self.limit.first_token_ms.get(request_id, 0.0))


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")


@dataclass(slots=True)
class SchedulerOutput:
    """One step: which requests run and how many new tokens each computes.

    ``scheduled`` lists single-token requests (decodes) first, longest context first (the attention
    backend buckets runs of similar length: less padding), then prefill chunks in the order they were
    scheduled; the model runner lays the flat batch out in exactly this order.
    """

    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    # the rows that score a prompt, in row order (worker/prompt_logprobs.py): the runner returns their
    # logits after the sampled rows', the engine reads them there
    score_spans: list[ScoreSpan] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        policies: WorkerPolicies | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock  # the "now" orderings see (tierserve.testing runs a simulated one)
        self.kv_cache = kv_cache
        self.policies = policies or WorkerPolicies.baseline()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.check(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """ValueError if ``request`` could never be added (a duplicate id, or more KV than the cache)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        max_tokens = self.kv_cache.pool.num_blocks * self.kv_cache.block_size
        if request.num_prompt_tokens + request.sampling_params.max_tokens > max_tokens:
            # Such a request could never run even alone; refusing it keeps the loop live.
            raise ValueError(
                f"request needs {request.num_prompt_tokens + request.sampling_params.max_tokens} "
                f"tokens of KV cache, the whole cache holds {max_tokens}"
            )

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        limits = StepLimits(self.config.max_num_batched_tokens, self.config.max_num_seqs, self.clock())
        step = self.policies.budget.budget(self.running, self.waiting, limits)
        budget = max(1, min(step.max_num_tokens, limits.max_num_batched_tokens))
        max_seqs = max(1, min(step.max_num_seqs, limits.max_num_seqs))
        clock = _StepClock(step.time_limit)
        admitting = True
        for view in self.policies.ordering.order([*self.running, *self.waiting], self.clock()):
            request = self.requests[view.request_id]
            if budget <= 0 or len(out.num_scheduled_tokens) >= max_seqs:
                break
            if request.status is RequestStatus.RUNNING:
                budget -= self._schedule_running(request, budget, out, clock)
            elif admitting and not out.preempted and request.status is not RequestStatus.FINISHED:
                num_new = self._admit(request, budget, out, clock)
                if num_new is None:
                    # Blocks ran out: nobody later in the order is admitted either, but running
                    # requests still get their tokens (they are what frees blocks).
                    admitting = False
                    continue
                budget -= num_new
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        scheduled = [r for r in self.running if r.request_id in out.num_scheduled_tokens]

        def layout(r: Request) -> tuple[bool, int]:
            is_decode = out.num_scheduled_tokens[r.request_id] == 1
            return (not is_decode, -r.num_tokens if is_decode else 0)

        out.scheduled = sorted(scheduled, key=layout)
        out.score_spans = score_spans(out.scheduled, out.num_scheduled_tokens)
        return out

    def _schedule_running(
        self, request: Request, budget: int, out: SchedulerOutput, clock: _StepClock
    ) -> int:
        """Give a running request its next tokens, preempting until its blocks fit; the tokens used
        (net of budget given back by victims that were already scheduled this step)."""
        num_new = min(request.num_tokens - request.num_computed_tokens, _chunk_budget(request, budget))
        num_new = clock.allowed(
            request.request_id, num_new, request.num_computed_tokens, not out.num_scheduled_tokens
        )
        if num_new == 0:
            return 0  # sits this step out, keeping its KV
        returned = 0
        while not self.kv_cache.allocate_slots(request, num_new):
            candidates = [r for r in self.running if r.status is RequestStatus.RUNNING]
            victim = self.requests[self.policies.preemption.victim(candidates).request_id]
            assert victim in candidates, f"the preemption policy chose {victim.request_id}, not running"
            self._preempt(victim, out)
            returned += out.num_scheduled_tokens.pop(victim.request_id, 0)
            if victim is request:
                return -returned
        clock.charge(request.request_id, num_new, request.num_computed_tokens)
        out.num_scheduled_tokens[request.request_id] = num_new
        return num_new - returned

    def _admit(self, request: Request, budget: int, out: SchedulerOutput, clock: _StepClock) -> int | None:
        """Admit a waiting request with its prefix hits; the tokens scheduled (net of any its victims
        give back), 0 if it must wait for a sequence slot or for time in a later step, None if the
        blocks ran out.

        With every sequence slot taken, or too few free blocks, a request may take the slot or the
        blocks of running requests of less urgent tiers: the preemption policy chooses among those
        and the request itself (choosing it means it waits)."""
        is_full = len(self.running) >= self.config.max_num_seqs
        donors = self._slot_donors(request) if is_full else []
        if is_full and not donors:
            return 0
        hits = self.kv_cache.get_computed_blocks(request)
        num_before = request.num_computed_tokens + len(hits) * self.kv_cache.block_size
        num_new = min(request.num_tokens - num_before, _chunk_budget(request, budget))
        num_new = clock.allowed(request.request_id, num_new, num_before, not out.num_scheduled_tokens)
        if num_new == 0:
            return 0
        returned = 0
        if is_full:
            given = self._give_way(request, out, donors)
            if given is None:
                return 0
            returned += given
        while not self.kv_cache.allocate_slots(request, num_new, hits):
            given = self._give_way(request, out, self._less_urgent(request))
            if given is None:
                return None
            returned += given
        clock.charge(request.request_id, num_new, num_before)
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = len(hits) * self.kv_cache.block_size
        request.status = RequestStatus.RUNNING
        self.waiting.remove(request)
        self.running.append(request)
        out.num_scheduled_tokens[request.request_id] = num_new
        return num_new - returned

    def _less_urgent(self, request: Request) -> list[Request]:
        rank = request.tier_rank
        return [r for r in self.running if r.status is RequestStatus.RUNNING and r.tier_rank > rank]

    def _slot_donors(self, request: Request) -> list[Request]:
        """Who waiting ``request`` may take a sequence slot from: running requests of less urgent
        tiers, else those the ordering's slot sharing names (fairness within the tier)."""
        less_urgent = self._less_urgent(request)
        ordering = self.policies.ordering
        if less_urgent or not isinstance(ordering, SlotSharing):
            return less_urgent
        running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        views = ordering.slot_donors(request, running, self.waiting, self.config.max_num_seqs)
        donors = [self.requests[v.request_id] for v in views]
        assert all(d in running for d in donors), "the ordering named a donor that is not running"
        return donors

    def _give_way(self, request: Request, out: SchedulerOutput, candidates: list[Request]) -> int | None:
        """Preempt one of ``candidates`` (running requests ``request`` may displace) for waiting
        ``request``, as the preemption policy chooses; the tokens the victim had been given this
        step, or None when there is no candidate or the policy chose ``request`` itself (it waits).

        Candidates of less urgent tiers are offered with ``request`` among them (the policy may
        prefer that it waits); donors of its own tier (slot sharing) without: the ordering has
        decided that one of them gives way, the preemption policy only picks which."""
        if not candidates:
            return None
        same_tier = all(r.tier_rank == request.tier_rank for r in candidates)
        offered = candidates if same_tier else [*candidates, request]
        victim = self.requests[self.policies.preemption.victim(offered).request_id]
        if victim is request:
            return None
        assert victim in candidates, f"the preemption policy chose {victim.request_id}, not a candidate"
        self._preempt(victim, out)
        self.running.remove(victim)
        return out.num_scheduled_tokens.pop(victim.request_id, 0)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def postprocess(self, out: SchedulerOutput) -> list[Request]:
        """After the runner computed the step: advance each scheduled request's counters and publish
        its newly full blocks; returns the requests that now need a token (their computed tokens
        reached their tokens: a decode, or a prefill's last chunk), in ``out.scheduled`` order. A
        request's first such step starts its TPOT clock (``first_token_time``)."""
        for request in out.scheduled:
            request.num_computed_tokens += out.num_scheduled_tokens[request.request_id]
            self.kv_cache.cache_computed_blocks(request)
        sampled = [r for r in out.scheduled if r.num_computed_tokens == r.num_tokens]
        now = self.clock()
        for request in sampled:
            if request.first_token_time is None:
                request.first_token_time = now
        return sampled

    def check_integrity(self) -> None:
        """The KV cache's invariants over every live request (tests call it after steps)."""
        self.kv_cache.check_integrity(self.requests.values())

    def report_step(self, out: SchedulerOutput, elapsed_ms: float) -> None:
        """Tell the budget policy what a finished step cost."""
        num_context = sum(r.num_computed_tokens for r in out.scheduled)
        num_decodes = sum(n == 1 for n in out.num_scheduled_tokens.values())
        self.policies.budget.observe(
            StepReport(out.total_num_tokens, len(out.scheduled), num_context, elapsed_ms, num_decodes)
        )

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """Remove a request (finished or aborted) and free its blocks; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return request


def _chunk_budget(request: Request, budget: int) -> int:
    """The tokens ``request`` may take of the step's ``budget``: a scored prompt's chunks are capped
    (their rows' logits come back with the step)."""
    return min(budget, SCORE_CHUNK_TOKENS) if request.scores_prompt else budget
