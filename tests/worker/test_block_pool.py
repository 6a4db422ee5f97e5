"""The block pool and KV cache manager under random operation sequences."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from wire.sampling import SamplingParams
from worker.kv_cache import BlockPool, KVCacheManager
from worker.request import Request

BLOCK_SIZE = 4
NUM_BLOCKS = 12


def make_request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=1), cache_salt=salt)


class KVCacheMachine(RuleBasedStateMachine):
    """Allocate, append, share prefixes, free, preempt, evict: the counts always add up."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.running: dict[str, Request] = {}
        self.ids = itertools.count()
        # A few shared "system prompts" so prefix hits actually happen.
        self.prefixes = [[7] * 8, [1, 2, 3, 4, 5, 6, 7, 8, 9], [5] * 12]

    def _admit(self, request: Request) -> None:
        hits = self.kv.get_computed_blocks(request)
        num_hit_tokens = len(hits) * BLOCK_SIZE
        assert num_hit_tokens < request.num_tokens
        if self.kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits):
            assert request.num_computed_tokens == num_hit_tokens
            request.num_computed_tokens = request.num_tokens  # the step ran
            self.kv.cache_computed_blocks(request)
            self.running[request.request_id] = request
        else:
            assert request.block_ids == [] and request.num_computed_tokens == 0

    @rule(
        prefix=st.integers(0, 3),
        suffix=st.lists(st.integers(0, 9), min_size=1, max_size=10),
        salt=st.sampled_from([None, "tenant-a", "tenant-b"]),
    )
    def add_request(self, prefix: int, suffix: list[int], salt: str | None) -> None:
        tokens = (self.prefixes[prefix] if prefix < 3 else []) + suffix
        self._admit(make_request(f"r{next(self.ids)}", tokens, salt))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 9))
    def append_token(self, data: st.DataObject, token: int) -> None:
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        request.append_output_token(token)
        if self.kv.allocate_slots(request, 1):
            request.num_computed_tokens += 1
            self.kv.cache_computed_blocks(request)
        else:
            self._preempt(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        del self.running[request.request_id]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free_or_preempt(self, data: st.DataObject, preempt: bool) -> None:
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        self._preempt(request)
        if preempt:  # resume by recompute: full blocks should come back from the cache
            self._admit(request)

    @invariant()
    def counts_add_up(self) -> None:
        free, in_use, cached = self.kv.pool.counts()
        assert free + in_use + cached == NUM_BLOCKS
        self.kv.check_integrity(self.running.values())

    @invariant()
    def block_tables_hold_their_tokens(self) -> None:
        for request in self.running.values():
            assert len(request.block_ids) * BLOCK_SIZE >= request.num_computed_tokens
            assert len(set(request.block_ids)) == len(request.block_ids)


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase


def test_prefix_hit_needs_equal_salt() -> None:
    kv = KVCacheManager(16, BLOCK_SIZE)
    tokens = list(range(13))
    first = make_request("a", tokens, salt="tenant-a")
    assert kv.allocate_slots(first, len(tokens), kv.get_computed_blocks(first))
    first.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(first)
    kv.free(first)

    same_tenant = make_request("b", tokens, salt="tenant-a")
    assert len(kv.get_computed_blocks(same_tenant)) == 3
    other_tenant = make_request("c", tokens, salt="tenant-b")
    assert kv.get_computed_blocks(other_tenant) == []
    no_salt = make_request("d", tokens)
    assert kv.get_computed_blocks(no_salt) == []


def test_whole_prompt_cached_still_computes_last_token() -> None:
    kv = KVCacheManager(16, BLOCK_SIZE)
    tokens = list(range(8))  # exactly two full blocks
    first = make_request("a", tokens)
    assert kv.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    kv.cache_computed_blocks(first)
    kv.free(first)
    again = make_request("b", tokens)
    hits = kv.get_computed_blocks(again)
    assert len(hits) == 1  # the last block is recomputed so the last token yields logits


def test_lru_evicts_least_recently_freed_and_tail_first() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    for i, block in enumerate(a + b):
        pool.cache_block(block, bytes([i]))
    pool.free(reversed(a))  # a's tail first
    pool.free(reversed(b))
    # Allocation takes a[1] (a's tail, freed first) before a[0], and b's blocks last.
    first = pool.allocate(1)[0]
    assert first is a[1]
    assert pool.get_cached_block(bytes([1])) is None
    assert pool.get_cached_block(bytes([0])) is a[0]
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_allocate_slots_changes_nothing_on_failure() -> None:
    kv = KVCacheManager(3, BLOCK_SIZE)
    request = make_request("a", list(range(10)))
    assert kv.allocate_slots(request, 10)
    assert len(request.block_ids) == 3
    other = make_request("b", list(range(100, 105)))
    assert not kv.allocate_slots(other, 5)
    assert other.block_ids == [] and kv.num_free_blocks == 0
    kv.check_integrity([request, other])


def test_recorded_events_give_each_hash_its_latest_state_and_a_snapshot_covers_pending_ones() -> None:
    pool = BlockPool(2)
    assert pool.take_events() == ([], [])  # not recording yet
    pool.record_events()
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h-a")
    pool.cache_block(b, b"h-b")
    assert pool.take_events() == ([b"h-a", b"h-b"], [])
    assert pool.take_events() == ([], [])
    pool.free([a, b])
    (c,) = pool.allocate(1)  # evicts h-a (least recently freed)
    pool.cache_block(c, b"h-c")
    (d,) = pool.allocate(1)  # evicts h-b
    pool.cache_block(d, b"h-a")  # h-a again: its latest state is "stored"
    stored, removed = pool.take_events()
    assert sorted(stored) == [b"h-a", b"h-c"] and removed == [b"h-b"]
    pool.free([c])
    pool.allocate(1)  # evicts h-c
    assert pool.snapshot() == [b"h-a"] and pool.take_events() == ([], [])
    pool.check_integrity()
