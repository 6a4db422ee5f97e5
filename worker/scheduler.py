"""One scheduling model for prefill and decode.

Every request has ``num_computed_tokens`` and ``num_tokens``; a step gives some requests
``num_new_tokens`` each under a token budget, so a long prompt is prefilled in chunks while
other requests keep decoding in the same step. Running requests go first; when the KV cache
is full a victim chosen by the policy is preempted (its blocks freed, full ones stay cached)
and recomputed later. Pure Python: no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from worker.kv_cache import KVCacheManager
from worker.request import FinishReason, Request, RequestStatus
from worker.scheduling_policy import FcfsPolicy, SchedulingPolicy


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

    ``scheduled`` lists single-token requests (decodes) first, then prefill chunks; the model
    runner lays the flat batch out in this order.
    """

    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)

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
        policy: SchedulingPolicy | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.policy: SchedulingPolicy = policy or FcfsPolicy()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        max_tokens = self.kv_cache.pool.num_blocks * self.kv_cache.block_size
        if request.num_prompt_tokens + request.sampling_params.max_tokens > max_tokens:
            # Such a request could never run even alone; refusing it keeps the loop live.
            raise ValueError(
                f"request needs {request.num_prompt_tokens + request.sampling_params.max_tokens} "
                f"tokens of KV cache, the whole cache holds {max_tokens}"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_running: list[Request] = []

        # Running requests first: they hold KV already; starving them wastes it.
        queue = deque(self.running)
        while queue and budget > 0:
            request = queue.popleft()
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                # The policy picks among everyone running, this request included: it may be the victim.
                victim = self.policy.choose_victim([request, *queue, *scheduled_running])
                self._preempt(victim, out)
                if victim is request:
                    break
                if victim in queue:
                    queue.remove(victim)
                else:
                    scheduled_running.remove(victim)
                    budget += out.num_scheduled_tokens.pop(victim.request_id)
            else:
                scheduled_running.append(request)
                out.num_scheduled_tokens[request.request_id] = num_new
                budget -= num_new
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]

        # Admit waiting requests only when nobody was preempted: a preemption means the cache is full.
        if not out.preempted:
            self._admit_waiting(out, budget)

        scheduled = [r for r in self.running if r.request_id in out.num_scheduled_tokens]
        out.scheduled = sorted(scheduled, key=lambda r: out.num_scheduled_tokens[r.request_id] != 1)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        admitted: list[Request] = []
        for request in self.policy.order_waiting(list(self.waiting)):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            hits = self.kv_cache.get_computed_blocks(request)
            num_new = request.num_tokens - request.num_computed_tokens - len(hits) * self.kv_cache.block_size
            num_new = min(num_new, budget)
            if not self.kv_cache.allocate_slots(request, num_new, hits):
                break
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = len(hits) * self.kv_cache.block_size
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
        for request in admitted:
            self.waiting.remove(request)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance counters after the runner computed the step, and publish newly full blocks."""
        for request in out.scheduled:
            request.num_computed_tokens += out.num_scheduled_tokens[request.request_id]
            self.kv_cache.cache_computed_blocks(request)

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
