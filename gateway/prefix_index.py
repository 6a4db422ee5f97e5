"""The gateway's picture of one worker's prefix cache, for prefix-aware routing (policies/prefix_routing.py).

    worker:  KVEvents(seq 0) KVEvents(1) ... ── stored/removed block hashes ──▶ PrefixIndex.on_events
             KVSnapshot(seq, part i of n) ◀── ResyncKV ── whenever the index is stale
             Heartbeat(stats.kv_events_seq) ─────────────────────────────────▶ PrefixIndex.on_heartbeat

The hashes are the workers' own (wire.block_hash: chained, salted per tenant by the gateway's
cache_salt), so the gateway computes the same ones for an incoming prompt and counts how many of its
leading blocks a worker holds (:meth:`PrefixIndex.match`). Salting keeps tenants apart here too: one
tenant's prompt never matches another's blocks, so routing cannot reveal what another tenant sent.

Never trusted blindly: the index starts stale (a new or reconnected worker), and becomes stale again on a
gap in the KVEvents numbering, a broken snapshot, or a heartbeat that claims events which never arrived
(checked one heartbeat later, so events still on the wire are not mistaken for lost ones). A stale index
matches nothing until a :class:`~wire.messages.KVSnapshot` replaces it; the dispatcher asks for one
(:meth:`PrefixIndex.wants_resync`), again every ``RESYNC_RETRY_S`` while none comes.

Between routing a request and its prefill finishing, the worker does not hold its blocks yet; a burst
of requests with a new shared prefix would scatter. So routing records what it expects
(:meth:`PrefixIndex.expect`): the prompt's hashes count as held for ``expect_ttl_s`` (or until the
worker reports them stored or evicted). Expectations are bounded in number, oldest dropped first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from wire.block_hash import BlockHash
from wire.messages import KVEvents, KVSnapshot

RESYNC_RETRY_S = 2.0
EXPECT_TTL_S = 10.0
MAX_EXPECTED = 1 << 16  # expected hashes kept per worker


@dataclass(slots=True)
class PrefixIndex:
    """One worker's cached block hashes as far as its events tell, plus what routing expects there."""

    block_size: int
    expect_ttl_s: float = EXPECT_TTL_S
    hashes: set[BlockHash] = field(default_factory=set)
    expected: dict[BlockHash, float] = field(default_factory=dict)  # hash → expiry, oldest first
    applied_seq: int | None = None  # the last KVEvents applied; None while stale
    num_resyncs: int = 0  # snapshots asked for (a gap, a restart, a lost event)
    _claimed_seq: int = -1  # kv_events_seq from the previous heartbeat
    _resync_asked_at: float | None = None
    _parts: list[BlockHash] = field(default_factory=list)  # snapshot being received
    _next_part: int = 0
    _snapshot_seq: int = 0

    @property
    def num_blocks(self) -> int:
        """Blocks it holds or is expected to hold soon (expired expectations linger until pruned)."""
        return len(self.hashes) + len(self.expected)

    @property
    def is_fresh(self) -> bool:
        return self.applied_seq is not None

    def mark_stale(self) -> None:
        """Distrust everything received so far (the next :meth:`wants_resync` says yes)."""
        self.applied_seq = None
        self.hashes.clear()
        self._parts = []
        self._next_part = 0
        self._resync_asked_at = None
        self._claimed_seq = -1

    def wants_resync(self, now: float) -> bool:
        """Whether to send ResyncKV now: stale, and not asked within the last ``RESYNC_RETRY_S``."""
        if self.is_fresh:
            return False
        if self._resync_asked_at is not None and now - self._resync_asked_at < RESYNC_RETRY_S:
            return False
        self._resync_asked_at = now
        self.num_resyncs += 1
        return True

    # ---- what the worker tells us --------------------------------------------------------------

    def on_events(self, message: KVEvents) -> None:
        if self.applied_seq is None or message.seq <= self.applied_seq:
            return  # stale (a snapshot will cover it), or already covered by the snapshot
        if message.seq != self.applied_seq + 1 or message.block_size != self.block_size:
            self.mark_stale()
            return
        self.hashes.update(message.stored)
        self.hashes.difference_update(message.removed)
        for block_hash in message.stored:
            self.expected.pop(block_hash, None)
        for block_hash in message.removed:
            self.expected.pop(block_hash, None)
        self.applied_seq = message.seq

    def on_snapshot(self, message: KVSnapshot) -> None:
        if message.part == 0:
            self._parts = []
            self._next_part = 0
            self._snapshot_seq = message.seq
        elif message.part != self._next_part or message.seq != self._snapshot_seq:
            self.mark_stale()  # a part went missing: ask again
            return
        self._parts.extend(message.hashes)
        self._next_part = message.part + 1
        if self._next_part == message.num_parts:
            self.hashes = set(self._parts)
            self._parts = []
            self.block_size = message.block_size
            self.applied_seq = message.seq
            self._claimed_seq = message.seq

    def on_heartbeat(self, kv_events_seq: int) -> None:
        """Stale if the previous heartbeat claimed events that have still not arrived."""
        if self.applied_seq is not None and self.applied_seq < self._claimed_seq:
            self.mark_stale()
            return
        self._claimed_seq = kv_events_seq

    # ---- what routing asks ---------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash], now: float | None = None) -> int:
        """How many leading blocks of a prompt with these hashes the worker holds (or soon will)."""
        if not self.is_fresh:
            return 0
        now = time.monotonic() if now is None else now
        num = 0
        for block_hash in hashes:
            if block_hash not in self.hashes:
                expiry = self.expected.get(block_hash)
                if expiry is None or expiry < now:
                    break
            num += 1
        return num

    def expect(self, hashes: Sequence[BlockHash], now: float | None = None) -> None:
        """A request with these prompt hashes was just sent there: count them as held for a while."""
        now = time.monotonic() if now is None else now
        expiry = now + self.expect_ttl_s
        expected = self.expected
        for block_hash in hashes:
            if block_hash not in self.hashes:
                expected.pop(block_hash, None)  # re-insert: the dict stays ordered by expiry
                expected[block_hash] = expiry
        while expected:
            oldest, oldest_expiry = next(iter(expected.items()))
            if oldest_expiry >= now and len(expected) <= MAX_EXPECTED:
                break
            del expected[oldest]
