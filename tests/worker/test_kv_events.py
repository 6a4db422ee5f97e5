"""The worker's prefix-cache messages: numbered one by one across steps, split when one message cannot
carry a step's changes, a snapshot in parts stamped with the last number it covers."""

from __future__ import annotations

from worker.kv_cache import BlockPool
from worker.kv_events import KVEventLog


def cached_pool(num_blocks: int) -> tuple[BlockPool, KVEventLog]:
    pool = BlockPool(num_blocks)
    return pool, KVEventLog(pool, "w", block_size=16, max_hashes=3)


def test_each_step_s_changes_become_numbered_messages_split_at_the_cap() -> None:
    pool, log = cached_pool(8)
    assert log.events() == [] and log.seq == -1  # nothing changed: nothing sent, no number used
    blocks = pool.allocate(5)
    for i, block in enumerate(blocks):
        pool.cache_block(block, f"h{i}".encode())
    first = log.events()
    assert [m.seq for m in first] == [0, 1]  # five hashes, three per message
    assert [h for m in first for h in m.stored] == [f"h{i}".encode() for i in range(5)]
    pool.free(blocks)
    pool.allocate(4)  # 3 uncached blocks, then evicts h0 (the least recently freed)
    (second,) = log.events()
    assert (second.seq, second.stored, second.removed) == (2, [], [b"h0"])


def test_a_snapshot_comes_in_parts_as_of_the_last_number_sent() -> None:
    pool, log = cached_pool(8)
    for i, block in enumerate(pool.allocate(7)):
        pool.cache_block(block, f"h{i}".encode())
    log.events()  # seq 0..2
    parts = log.snapshot()
    assert [(p.part, p.num_parts, p.seq) for p in parts] == [(0, 3, 2), (1, 3, 2), (2, 3, 2)]
    assert sorted(h for p in parts for h in p.hashes) == sorted(f"h{i}".encode() for i in range(7))
    assert log.events() == []


def test_without_prefix_caching_there_is_nothing_to_tell() -> None:
    pool = BlockPool(4, enable_caching=False)
    log = KVEventLog(pool, "w", block_size=16)
    pool.cache_block(pool.allocate(1)[0], b"h")
    assert log.events() == [] and [(p.num_parts, p.hashes) for p in log.snapshot()] == [(1, [])]
