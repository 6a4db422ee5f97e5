"""The gateway's prefix index of one worker: built from KV events, never trusted when out of step.

Stale (and matching nothing) until a snapshot; stale again after a gap in the event numbers, a broken
snapshot, another block size, or a heartbeat claiming events that never came. Routing's expectations
count as held for a while, until the worker confirms or evicts them.
"""

from __future__ import annotations

from gateway.prefix_index import EXPECT_TTL_S, RESYNC_RETRY_S, PrefixIndex
from wire.block_hash import hash_blocks
from wire.messages import KVEvents, KVSnapshot

BLOCK = 4
SALT = "tenant-a"
PROMPT = list(range(40))  # 10 full blocks
HASHES = hash_blocks(PROMPT, BLOCK, SALT)


def events(seq: int, stored: list[bytes] = (), removed: list[bytes] = ()) -> KVEvents:  # type: ignore[assignment]
    return KVEvents(worker_id="w", seq=seq, block_size=BLOCK, stored=list(stored), removed=list(removed))


def snapshot(seq: int, hashes: list[bytes], part: int = 0, num_parts: int = 1) -> KVSnapshot:
    return KVSnapshot(worker_id="w", seq=seq, block_size=BLOCK, part=part, num_parts=num_parts, hashes=hashes)


def synced(hashes: list[bytes] = (), seq: int = -1) -> PrefixIndex:  # type: ignore[assignment]
    index = PrefixIndex(BLOCK)
    index.on_snapshot(snapshot(seq, list(hashes)))
    return index


def test_a_new_index_is_stale_matches_nothing_and_asks_for_a_snapshot_then_retries_later() -> None:
    index = PrefixIndex(BLOCK)
    assert not index.is_fresh and index.match(HASHES, now=0.0) == 0
    assert index.wants_resync(10.0)
    assert not index.wants_resync(10.0 + RESYNC_RETRY_S / 2)  # asked already; the answer may be on its way
    assert index.wants_resync(10.0 + RESYNC_RETRY_S)  # nothing came: ask again
    index.on_events(events(0, HASHES))  # events before the snapshot are covered by it
    assert index.match(HASHES, now=0.0) == 0
    index.on_snapshot(snapshot(0, HASHES[:3]))
    assert index.is_fresh and not index.wants_resync(100.0)
    assert index.match(HASHES, now=0.0) == 3


def test_events_in_order_store_and_evict_and_the_match_is_the_leading_run() -> None:
    index = synced()
    index.on_events(events(0, HASHES[:6]))
    assert index.match(HASHES, now=0.0) == 6
    index.on_events(events(1, removed=[HASHES[2]]))
    assert index.match(HASHES, now=0.0) == 2  # block 3.. are useless without block 2
    assert index.match(hash_blocks(PROMPT, BLOCK, "tenant-b"), now=0.0) == 0  # another tenant's salt


def test_a_gap_in_the_numbering_makes_it_stale_until_the_next_snapshot() -> None:
    index = synced()
    index.on_events(events(0, HASHES[:2]))
    index.on_events(events(2, HASHES[2:4]))  # seq 1 was lost
    assert not index.is_fresh and index.match(HASHES, now=0.0) == 0
    assert index.wants_resync(0.0)
    index.on_events(events(3, HASHES[4:5]))  # ignored: the snapshot will cover it
    index.on_snapshot(snapshot(3, HASHES[:5]))
    index.on_events(events(4, HASHES[5:6]))
    assert index.match(HASHES, now=0.0) == 6


def test_a_snapshot_in_parts_applies_once_whole_and_a_missing_part_means_stale() -> None:
    index = PrefixIndex(BLOCK)
    index.on_snapshot(snapshot(7, HASHES[:4], part=0, num_parts=2))
    assert not index.is_fresh
    index.on_snapshot(snapshot(7, HASHES[4:8], part=1, num_parts=2))
    assert index.is_fresh and index.match(HASHES, now=0.0) == 8 and index.applied_seq == 7

    broken = PrefixIndex(BLOCK)
    broken.on_snapshot(snapshot(7, HASHES[:4], part=0, num_parts=3))
    broken.on_snapshot(snapshot(7, HASHES[8:], part=2, num_parts=3))  # part 1 lost
    assert not broken.is_fresh and broken.wants_resync(0.0)


def test_a_heartbeat_claiming_events_that_never_arrive_makes_it_stale_one_heartbeat_later() -> None:
    index = synced()
    index.on_events(events(0, HASHES[:1]))
    index.on_heartbeat(1)  # event 1 may still be on the wire: not yet a loss
    assert index.is_fresh
    index.on_events(events(1, HASHES[1:2]))
    index.on_heartbeat(3)
    assert index.is_fresh
    index.on_heartbeat(3)  # events 2 and 3 never came
    assert not index.is_fresh


def test_events_of_another_block_size_are_not_trusted() -> None:
    index = synced()
    index.on_events(KVEvents(worker_id="w", seq=0, block_size=BLOCK * 2, stored=HASHES[:1]))
    assert not index.is_fresh


def test_expected_blocks_count_until_they_expire_or_the_worker_evicts_them() -> None:
    index = synced()
    index.expect(HASHES, now=100.0)
    assert index.match(HASHES, now=100.0 + EXPECT_TTL_S / 2) == len(HASHES)
    assert index.match(HASHES, now=100.0 + EXPECT_TTL_S + 1) == 0
    index.expect(HASHES, now=200.0)
    index.on_events(events(0, stored=HASHES[:5], removed=[HASHES[5]]))
    assert index.match(HASHES, now=200.0) == 5  # evicted: no longer expected either
    assert index.match(HASHES, now=200.0 + EXPECT_TTL_S + 1) == 5  # confirmed ones do not expire


def test_expectations_are_bounded_oldest_first() -> None:
    import gateway.prefix_index as prefix_index

    index = synced()
    many = hash_blocks(list(range(4 * (prefix_index.MAX_EXPECTED + 10))), BLOCK, SALT)
    index.expect(many, now=0.0)
    assert len(index.expected) == prefix_index.MAX_EXPECTED
    assert many[-1] in index.expected and many[0] not in index.expected
