"""Built-in preemption victims: ``newest`` (the baseline) and ``lowest-tier``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from policies.base import NoParams, SeqView


class Newest:
    """The most recent arrival gives its blocks back: it has had the least time, so it loses least."""

    kind: ClassVar[str] = "preemption"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        pass

    def victim(self, candidates: Sequence[SeqView]) -> SeqView:
        return max(candidates, key=lambda r: r.arrival_time)


class LowestTier:
    """The least urgent tier gives way first; within it the largest ``priority`` value (vLLM's order),
    then the request with the least progress (fewest computed tokens: the cheapest to recompute),
    then the newest.

    Invariant beyond the Protocol's: never preempts a request while one of a less urgent tier runs.
    """

    kind: ClassVar[str] = "preemption"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        pass

    def victim(self, candidates: Sequence[SeqView]) -> SeqView:
        return max(
            candidates, key=lambda r: (r.tier_rank, r.priority, -r.num_computed_tokens, r.arrival_time)
        )
