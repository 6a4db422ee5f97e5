"""``prefix-load`` routing: send a request where its prompt's prefix is already cached, unless that
worker is so much busier than another that waiting there costs more than computing the prefix again.

Each candidate gets a score; the highest wins::

    score = cached_fraction − load_weight · load − kv_weight · kv_usage

    cached_fraction = num_cached_tokens / num_prompt_tokens    (the gateway's prefix index; 0 if stale)
    load            = num_load / max_num_seqs                  (requests on it per sequence slot)
    kv_usage        = fraction of its KV blocks in use

With the defaults, a worker holding 90% of the prompt keeps it until it carries about 1.8 requests per
slot more than an idle worker (0.9 / 0.5): short of that, a hit is worth more than a shorter queue.
Scores within ``tie_tolerance`` of the best are a tie, broken toward the least loaded worker and then
by rotation, so new prefixes (no worker holds them) spread across the fleet instead of piling onto the
first worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from policies.routing import RouteRequest, WorkerView


class PrefixLoadParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    load_weight: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    kv_weight: Annotated[float, msgspec.Meta(ge=0)] = 0.1
    tie_tolerance: Annotated[float, msgspec.Meta(ge=0)] = 0.02


class PrefixLoad:
    """Prefix-cache hits weighed against load (see the module docstring for the score)."""

    kind: ClassVar[str] = "routing"
    uses_prefix_index: ClassVar[bool] = True
    Params = PrefixLoadParams

    def __init__(self, params: PrefixLoadParams) -> None:
        self.params = params
        self.scores: dict[str, float] = {}  # the last decision's, by worker id (traces show them)
        self._next_tie = 0

    def score(self, request: RouteRequest, worker: WorkerView) -> float:
        params = self.params
        cached = worker.num_cached_tokens or 0
        cached_fraction = (
            min(cached / request.num_prompt_tokens, 1.0) if request.num_prompt_tokens > 0 else 0.0
        )
        load = worker.num_load / max(worker.max_num_seqs, 1)
        return cached_fraction - params.load_weight * load - params.kv_weight * worker.kv_usage

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> int:
        scores = [self.score(request, worker) for worker in candidates]
        self.scores = {worker.worker_id: round(s, 4) for worker, s in zip(candidates, scores, strict=True)}
        best = max(scores)
        tied = [i for i, s in enumerate(scores) if s >= best - self.params.tie_tolerance]
        least = min(candidates[i].num_load for i in tied)
        tied = [i for i in tied if candidates[i].num_load == least]
        chosen = tied[self._next_tie % len(tied)]
        self._next_tie += 1
        return chosen
