"""Per-request view of the block pool: prefix hits, slot allocation, caching and freeing.

A request's block table maps its token positions onto pool blocks:

    position p  ──▶  block_ids[p // block_size], offset p % block_size
    slot        =    block_ids[p // block_size] * block_size + p % block_size

Check and act are one call (``allocate_slots`` returns False and changes nothing when the
pool cannot hold the step), so the scheduler never leaves a request half allocated. The request owns
its block table (``Request.blocks``, and ``Request.block_ids`` the runner reads); this manager keeps
no copy of it.
"""

from __future__ import annotations

from collections.abc import Iterable

from policies.base import EvictionPolicy
from wire.block_hash import hash_blocks
from worker.kv_cache.block_pool import BlockPool, KVBlock
from worker.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, eviction=eviction)
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0  # in tokens

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` over every full block of its tokens (its outputs' blocks
        marked: wire/block_hash.py)."""
        start = len(request.block_hashes)
        parent = request.block_hashes[-1] if start else None
        request.block_hashes.extend(
            hash_blocks(
                request.all_token_ids,
                self.block_size,
                request.cache_salt,
                parent,
                start,
                num_prompt_tokens=request.outputs_from,
            )
        )

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest cached prefix of a request that holds no blocks yet.

        The last token is always recomputed (its logits pick the next token), so a prompt that
        is entirely cached still leaves its last block to compute. A request that scores its prompt
        (``Request.scores_prompt``) computes all of it: no hits.
        """
        if not self.enable_prefix_caching or request.scores_prompt:
            return []
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += len(hits) * self.block_size
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones, or change nothing.

        ``computed_blocks`` are prefix hits (from ``get_computed_blocks``) for a request that
        holds no blocks yet; on success they become the head of its block table and its
        ``num_computed_tokens`` covers them.
        """
        computed_blocks = computed_blocks or []
        owned = request.blocks
        assert not (computed_blocks and owned), "prefix hits only for a request without blocks"
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = self.blocks_needed(num_computed + num_new_tokens) - len(owned) - len(computed_blocks)
        # Hit blocks with no other reference sit in the free list: taking them shrinks it too.
        num_hits_from_free = sum(1 for b in computed_blocks if b.ref_count == 0)
        if max(num_needed, 0) > self.pool.num_free_blocks - num_hits_from_free:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            self._own(request, computed_blocks)
            request.num_computed_tokens = num_computed
            request.num_published_blocks = len(computed_blocks)  # cached already: they were hits
        if num_needed > 0:
            self._own(request, self.pool.allocate(num_needed))
        return True

    @staticmethod
    def _own(request: Request, blocks: list[KVBlock]) -> None:
        request.blocks.extend(blocks)
        request.block_ids.extend(b.block_id for b in blocks)

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the full blocks whose KV became computed since the last call, so later requests can
        hit them (only the new range is hashed and published)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.blocks))
        if num_full <= request.num_published_blocks:
            return
        self.update_block_hashes(request)
        start = request.num_published_blocks
        for block, block_hash in zip(
            request.blocks[start:num_full], request.block_hashes[start:num_full], strict=True
        ):
            self.pool.cache_block(block, block_hash)
        request.num_published_blocks = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first; full computed blocks stay cached."""
        self.pool.free(reversed(request.blocks), request.tier.rank)
        request.blocks, request.block_ids = [], []
        request.num_published_blocks = 0

    def check_integrity(self, requests: Iterable[Request] = ()) -> None:
        """The pool's invariants, and that none of ``requests`` (the live ones) holds a freed block."""
        self.pool.check_integrity()
        for request in requests:
            name = request.request_id
            assert all(b.ref_count > 0 for b in request.blocks), f"{name} holds a freed block"
            assert request.block_ids == [b.block_id for b in request.blocks], f"{name}: block ids drifted"
