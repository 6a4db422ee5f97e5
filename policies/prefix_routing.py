"""``prefix-load`` routing: send a request where its prompt's prefix is already cached, unless that
worker is much busier than the rest of the fleet; spread prefixes nobody holds over the fleet's caches.

Candidates carrying far more requests than the least loaded one are set aside first (a hot prefix then
spills onto a second worker, which caches it too)::

    overloaded  =  num_load > balance_rel · (min_load + 1) + balance_abs

Each remaining candidate gets a score; the highest wins::

    score = hit − load_weight · num_load / max_num_seqs − cache_weight · cache_usage

    hit         = num_cached_tokens / num_prompt_tokens (the gateway's prefix index; 0 if stale),
                  counted as 0 below min_hit_fraction
    cache_usage = num_cached_blocks / num_total_blocks  (what its prefix cache holds or soon will)

A worker holding most of the prompt wins unless it is overloaded: a hit saves a prefill, while on a
continuous-batching worker a few more requests only share its steps. ``min_hit_fraction`` keeps a match
on blocks every prompt shares (a chat template's preamble) from pulling new prompts onto whichever
worker saw any prompt first. For a prompt nobody holds the cache term decides: it goes to the worker
caching the least, so distinct prefixes spread over the fleet instead of piling on one cache. Scores
within ``tie_tolerance`` of the best tie; a tie goes to the least loaded worker, then by rotation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from policies.routing import RouteRequest, WorkerView


class PrefixLoadParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    min_hit_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.2
    load_weight: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    cache_weight: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    balance_abs: Annotated[float, msgspec.Meta(ge=0)] = 8.0
    balance_rel: Annotated[float, msgspec.Meta(ge=1)] = 1.5
    tie_tolerance: Annotated[float, msgspec.Meta(ge=0)] = 0.02


class PrefixLoad:
    """Prefix-cache hits weighed against load and cache spread (see the module docstring)."""

    kind: ClassVar[str] = "routing"
    uses_prefix_index: ClassVar[bool] = True
    Params = PrefixLoadParams

    def __init__(self, params: PrefixLoadParams) -> None:
        self.params = params
        self.scores: dict[str, float] = {}  # the last decision's, by worker id (traces show them)
        self._next_tie = 0

    def hit(self, request: RouteRequest, worker: WorkerView) -> float:
        """The fraction of the prompt the worker holds, or 0 below ``min_hit_fraction``."""
        num_prompt = request.num_prompt_tokens
        fraction = min((worker.num_cached_tokens or 0) / num_prompt, 1.0) if num_prompt > 0 else 0.0
        return fraction if fraction >= self.params.min_hit_fraction else 0.0

    def score(self, request: RouteRequest, worker: WorkerView) -> float:
        params = self.params
        load = worker.num_load / max(worker.max_num_seqs, 1)
        total = worker.num_total_blocks or 0
        cache_usage = min((worker.num_cached_blocks or 0) / total, 1.0) if total > 0 else 0.0
        return self.hit(request, worker) - params.load_weight * load - params.cache_weight * cache_usage

    def is_overloaded(self, worker: WorkerView, min_load: int) -> bool:
        return worker.num_load > self.params.balance_rel * (min_load + 1) + self.params.balance_abs

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> int:
        min_load = min(worker.num_load for worker in candidates)
        scores = [self.score(request, worker) for worker in candidates]
        self.scores = {worker.worker_id: round(s, 4) for worker, s in zip(candidates, scores, strict=True)}
        # The least loaded candidate is never overloaded, so some candidate is always eligible.
        eligible = [i for i, worker in enumerate(candidates) if not self.is_overloaded(worker, min_load)]
        best = max(scores[i] for i in eligible)
        tied = [i for i in eligible if scores[i] >= best - self.params.tie_tolerance]
        least = min(candidates[i].num_load for i in tied)
        tied = [i for i in tied if candidates[i].num_load == least]
        chosen = tied[self._next_tie % len(tied)]
        self._next_tie += 1
        return chosen
