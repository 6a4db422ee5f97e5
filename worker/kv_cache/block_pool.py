"""The block pool: ref counts, O(1) LRU free lists and the hash → block map.

A block is in exactly one of three states:

    in use   ref_count > 0                     (owned by one or more running requests)
    cached   ref_count == 0, block_hash set    (in its tier's cached list, reusable on a prefix hit)
    free     ref_count == 0, no hash           (in the uncached list)

Allocation takes an uncached block while there is one (evicting nothing); otherwise it evicts a
cached one: the eviction policy (policies/eviction.py) picks among the least recently freed cached
block of each tier (by the rank of the request that last freed it). Each list is ordered least
recently freed first; a prefix hit pulls a cached block out of the middle in O(1), which is why the
lists are intrusive (each block carries its own links).

Once :meth:`BlockPool.record_events` is called, the pool also remembers how the hash → block map changed since
:meth:`BlockPool.take_events` was last called (last change per hash wins), which the worker daemon
publishes as KVEvents for the gateway's prefix-aware routing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from policies.base import EvictionCandidate, EvictionPolicy, NoParams
from policies.eviction import Lru
from wire.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    tier_rank: int = 0  # of the request that last freed it: which cached list it waits in
    last_used: float = 0.0  # monotonic time it was last freed
    prev: KVBlock | None = None
    next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list of blocks with ref_count 0: O(1) popleft, remove, append."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        # Sentinels keep every operation free of head/tail special cases.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, f"{block} is not in the free list"
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_blocks -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None and block.prev is None and block.next is None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_blocks += 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next

    def __len__(self) -> int:
        return self.num_blocks

    def head(self) -> KVBlock | None:
        block = self._head.next
        return None if block is self._tail else block


class BlockPool:
    """Owns every block and the prefix-cache index. Knows nothing about requests."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        eviction: EvictionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.eviction: EvictionPolicy = eviction or Lru(NoParams())
        self._clock = clock
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.uncached = FreeBlockQueue(self.blocks)
        self.cached_lists: dict[int, FreeBlockQueue] = {}  # tier rank → its free cached blocks
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        # hash → True (now cached) / False (evicted) since the last take_events; None: not recording.
        self._events: dict[BlockHash, bool] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free plus cached-but-unreferenced."""
        return len(self.uncached) + sum(len(q) for q in self.cached_lists.values())

    def _list_of(self, block: KVBlock) -> FreeBlockQueue:
        if block.block_hash is None:
            return self.uncached
        queue = self.cached_lists.get(block.tier_rank)
        if queue is None:
            queue = self.cached_lists[block.tier_rank] = FreeBlockQueue(())
        return queue

    def free_blocks(self) -> Iterator[KVBlock]:
        """Every block with no reference: the uncached ones, then each tier's cached ones."""
        yield from self.uncached
        for queue in self.cached_lists.values():
            yield from queue

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling unreferenced ones off their free list."""
        for block in blocks:
            if block.ref_count == 0:
                self._list_of(block).remove(block)
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        allocated = []
        for _ in range(num_blocks):
            block = self._take()
            self._evict(block)
            block.ref_count = 1
            allocated.append(block)
        return allocated

    def _take(self) -> KVBlock:
        """An uncached block if any; else the cached block the eviction policy picks among the
        least recently freed of each tier."""
        if len(self.uncached):
            return self.uncached.popleft()
        heads = [(rank, q.head()) for rank, q in self.cached_lists.items() if len(q)]
        candidates = [EvictionCandidate(rank, block.last_used) for rank, block in heads if block is not None]
        choice = self.eviction.choose(candidates, self._clock()) if len(candidates) > 1 else 0
        return self.cached_lists[candidates[choice].tier_rank].popleft()

    def free(self, blocks: Iterable[KVBlock], tier_rank: int = 0) -> None:
        """Drop one reference each; pass a request's blocks tail first so its tail is evicted first.
        ``tier_rank``: the freeing request's tier, which decides how long a cached block is kept."""
        now = self._clock()
        for block in blocks:
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                block.tier_rank = tier_rank
                block.last_used = now
                self._list_of(block).append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # another request computed the same prefix; this copy stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self._events is not None:
            self._events[block_hash] = True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self._events is not None:
                    self._events[block.block_hash] = False
            block.block_hash = None
            self.num_evictions += 1

    def record_events(self) -> None:
        """From now on, remember changes for :meth:`take_events` (whoever calls this must take them)."""
        if self._events is None:
            self._events = {}

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, removed) hashes since the last call: each hash in one list, by its latest state.
        A hash stored and evicted again in between is reported removed (harmless to a reader)."""
        if not self._events:
            return [], []
        events, self._events = self._events, {}
        stored = [h for h, is_cached in events.items() if is_cached]
        removed = [h for h, is_cached in events.items() if not is_cached]
        return stored, removed

    def snapshot(self) -> list[BlockHash]:
        """Every cached hash now; pending events are dropped (the snapshot covers them)."""
        if self._events is not None:
            self._events = {}
        return list(self.cached)

    def counts(self) -> tuple[int, int, int]:
        """(free, in use, cached) block counts."""
        in_use = sum(1 for b in self.blocks if b.ref_count > 0)
        cached = self.num_free_blocks - len(self.uncached)
        return len(self.uncached), in_use, cached

    def check_integrity(self) -> None:
        """Assert the pool's invariants; cheap enough for tests, not for every step."""
        free, in_use, cached = self.counts()
        assert free + in_use + cached == self.num_blocks, (free, in_use, cached, self.num_blocks)
        listed = list(self.free_blocks())
        in_queue = {id(b) for b in listed}
        assert len(in_queue) == len(listed), "a block is in the free lists twice"
        assert all(b.block_hash is None for b in self.uncached), "a cached block in the uncached list"
        for rank, queue in self.cached_lists.items():
            assert all(b.block_hash is not None and b.tier_rank == rank for b in queue), f"tier {rank} list"
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert (block.ref_count == 0) == (id(block) in in_queue), f"{block} ref/free-list mismatch"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"{block} indexed under a stale hash"
