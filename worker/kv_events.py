"""What a worker tells its gateways about its prefix cache (their routing indexes, gateway/prefix_index.py).

After every engine step that changed the cache: the block hashes stored and evicted since the last step,
as ``KVEvents`` numbered 0, 1, 2, ... for the life of the process (one numbering for every gateway, so
each can tell a gap from a quiet spell). On ``ResyncKV``: every cached hash as a ``KVSnapshot`` in as
many parts as it takes, stamped with the number of the last ``KVEvents`` it already covers.
"""

from __future__ import annotations

from wire.messages import MAX_KV_HASHES, KVEvents, KVSnapshot
from worker.kv_cache.block_pool import BlockPool


class KVEventLog:
    """Turns the block pool's recorded changes into numbered messages (sending is the caller's)."""

    def __init__(
        self, pool: BlockPool, worker_id: str, block_size: int, max_hashes: int = MAX_KV_HASHES
    ) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.block_size = block_size
        self.max_hashes = max_hashes  # per message (wire.messages caps it)
        self.seq = -1  # the last KVEvents numbered; -1 before the first
        if pool.enable_caching:
            pool.record_events()

    def events(self) -> list[KVEvents]:
        """The changes since the last call: usually one message, none when nothing changed. More than
        one message carries stored hashes first, then removed ones (a hash is in one list only)."""
        stored, removed = self.pool.take_events()
        size = self.max_hashes
        if len(stored) + len(removed) <= size:
            batches = [(stored, removed)] if stored or removed else []
        else:
            batches = [(stored[i : i + size], []) for i in range(0, len(stored), size)]
            batches += [([], removed[i : i + size]) for i in range(0, len(removed), size)]
        messages = []
        for batch_stored, batch_removed in batches:
            self.seq += 1
            messages.append(
                KVEvents(
                    worker_id=self.worker_id,
                    seq=self.seq,
                    block_size=self.block_size,
                    stored=batch_stored,
                    removed=batch_removed,
                )
            )
        return messages

    def snapshot(self) -> list[KVSnapshot]:
        """Every cached hash now, as of KVEvents ``seq`` (changes not yet sent are in it, and dropped)."""
        hashes = self.pool.snapshot()
        size = self.max_hashes
        num_parts = max(1, -(-len(hashes) // size))
        return [
            KVSnapshot(
                worker_id=self.worker_id,
                seq=self.seq,
                block_size=self.block_size,
                part=part,
                num_parts=num_parts,
                hashes=hashes[part * size : (part + 1) * size],
            )
            for part in range(num_parts)
        ]
