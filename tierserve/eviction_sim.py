"""An eviction policy's harness: free cached blocks, one LRU list per tier, as the worker's block pool
keeps them; the policy picks which tier's oldest block goes (``tierserve.testing`` exports it). Pure
Python: no torch."""

from __future__ import annotations

import bisect
from collections.abc import Hashable

from policies.base import EvictionCandidate, EvictionPolicy
from tierserve.sim_types import PolicyContractError


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
