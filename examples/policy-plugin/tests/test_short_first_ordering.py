"""ordering.short-first: direct cases on hand-made views, then the harness with long and short prompts."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from tierserve_short_first import ShortFirst, ShortFirstParams

from policies.ordering import Tiered, TieredParams
from tierserve.testing import SimConfig, SimRequest, simulate
from wire.tier import DEFAULT_TIERS

STANDARD = DEFAULT_TIERS[1]


@dataclass(frozen=True)
class View:
    """A request as the ordering sees it."""

    request_id: str
    num_prompt_tokens: int = 100
    num_computed_tokens: int = 0
    arrival_time: float = 0.0
    tier_rank: int = 1
    priority: int = 0
    tier_name: str = "standard"
    tenant: str | None = None
    num_output_tokens: int = 0
    tpot_ms: float | None = None
    ttft_deadline: float | None = None
    first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


def ids(requests: list) -> list[str]:
    return [r.request_id for r in requests]


def short_first(max_wait_s: float = 10.0) -> ShortFirst:
    return ShortFirst(ShortFirstParams(max_wait_s=max_wait_s))


def test_the_fewest_tokens_left_go_first() -> None:
    requests = [
        View("long", num_prompt_tokens=4000, arrival_time=0.0),
        View("long-half-done", num_prompt_tokens=4000, num_computed_tokens=3000, arrival_time=0.5),
        View("short", num_prompt_tokens=30, arrival_time=1.0),
        View("decode", num_prompt_tokens=4000, num_computed_tokens=4000, arrival_time=2.0),
    ]
    assert ids(short_first().order(requests, now=3.0)) == ["decode", "short", "long-half-done", "long"]


def test_tiers_and_priority_come_before_length() -> None:
    requests = [
        View("short-batch", num_prompt_tokens=10, tier_rank=2),
        View("short-low", num_prompt_tokens=10, priority=1),
        View("long", num_prompt_tokens=5000),
    ]
    assert ids(short_first().order(requests, now=0.0)) == ["long", "short-low", "short-batch"]


def test_a_request_waiting_past_max_wait_goes_ahead_by_arrival() -> None:
    requests = [
        View("short", num_prompt_tokens=10, arrival_time=9.0),
        View("long-late", num_prompt_tokens=3000, arrival_time=4.0),
        View("long-early", num_prompt_tokens=5000, arrival_time=1.0),
    ]
    assert ids(short_first(max_wait_s=5.0).order(requests, now=8.0)) == ["long-early", "short", "long-late"]
    assert ids(short_first(max_wait_s=5.0).order(requests, now=9.5)) == ["long-early", "long-late", "short"]


def test_in_the_harness_short_prompts_skip_the_long_prefills_and_the_long_still_finish() -> None:
    # A backlog of document-length prompts, and chat turns arriving behind them, in one tier.
    longs = [SimRequest(f"long{i}", i * 0.1, STANDARD, 3000, 16) for i in range(40)]
    shorts = [SimRequest(f"short{i}", 0.05 + i * 0.1, STANDARD, 32, 16) for i in range(40)]
    config = SimConfig(max_num_batched_tokens=512, max_num_seqs=8)

    def ttfts(ordering: ShortFirst | Tiered) -> tuple[list[float], list[float]]:
        result = simulate(longs + shorts, ordering=ordering, config=config).requests
        assert all(r.finished for r in result.values())  # nobody starved
        by_kind: dict[bool, list[float]] = {True: [], False: []}
        for r in result.values():
            assert r.ttft_ms is not None
            by_kind[r.request_id.startswith("short")].append(r.ttft_ms)
        return by_kind[True], by_kind[False]

    short_sf, long_sf = ttfts(short_first(max_wait_s=5.0))
    short_tiered, long_tiered = ttfts(Tiered(TieredParams()))
    # Chat turns: a median of 0.6 s instead of 31 s behind the documents; the last document's first
    # token comes 1% later (aging puts a document waiting 5 s ahead of the chat turns).
    assert statistics.median(short_sf) * 10 < statistics.median(short_tiered)
    assert max(long_sf) < 1.1 * max(long_tiered)
