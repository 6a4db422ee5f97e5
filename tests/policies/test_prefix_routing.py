"""``prefix-load``: the worker holding the prompt's prefix wins unless it is overloaded against the
least loaded worker; matches below ``min_hit_fraction`` count as none; prompts nobody holds go to the
worker caching the least, exact ties spread evenly; the scores it weighed are left for the span."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from policies.prefix_routing import PrefixLoad, PrefixLoadParams
from policies.registry import load_policy
from policies.routing import RouteRequest, WorkerView

PROMPT_TOKENS = 1000


def request(num_prompt_tokens: int = PROMPT_TOKENS) -> RouteRequest:
    return RouteRequest(request_id="r", model="m", tier=None, num_prompt_tokens=num_prompt_tokens)


def worker(
    worker_id: str, *, cached: int | None = 0, load: int = 0, free: int = 100, blocks: int | None = 0
) -> WorkerView:
    return WorkerView(
        worker_id=worker_id,
        model="m",
        state="ready",
        max_num_seqs=8,
        num_in_flight=load,
        num_running=None,
        num_waiting=None,
        num_free_blocks=free,
        num_total_blocks=100,
        step_time_ema_ms=5.0,
        num_cached_tokens=cached,
        num_cached_blocks=blocks,
    )


def test_it_is_a_registered_routing_policy_that_asks_for_the_prefix_index() -> None:
    policy = load_policy("routing", "prefix-load", {"load_weight": 1.0, "min_hit_fraction": 0.5})
    assert isinstance(policy, PrefixLoad) and policy.params.load_weight == 1.0
    assert PrefixLoad.uses_prefix_index


def test_the_worker_holding_the_prefix_wins_over_idle_ones_and_the_scores_are_kept() -> None:
    policy = PrefixLoad(PrefixLoadParams())
    candidates = [worker("a"), worker("b", cached=960, load=4), worker("c")]
    assert policy.choose(request(), candidates) == 1
    assert set(policy.scores) == {"a", "b", "c"} and policy.scores["b"] > policy.scores["a"]


def test_a_worker_far_busier_than_the_least_loaded_one_loses_its_prefix_traffic() -> None:
    policy = PrefixLoad(PrefixLoadParams())  # overloaded: load > 1.5 · (min + 1) + 8
    assert policy.choose(request(), [worker("a", load=4), worker("b", cached=960, load=15)]) == 1
    assert policy.choose(request(), [worker("a", load=4), worker("b", cached=960, load=16)]) == 0


def test_a_match_on_shared_preamble_blocks_only_counts_as_none() -> None:
    policy = PrefixLoad(PrefixLoadParams())  # min_hit_fraction 0.2
    candidates = [worker("a", cached=32, blocks=60), worker("b", blocks=0)]
    assert policy.choose(request(), candidates) == 1  # 3% "hit" on a: a new prompt, placed by cache use


def test_a_prompt_nobody_holds_goes_to_the_worker_caching_the_least() -> None:
    policy = PrefixLoad(PrefixLoadParams())
    candidates = [worker("a", blocks=120), worker("b", blocks=60, load=1), worker("c", blocks=180)]
    assert policy.choose(request(), candidates) == 1


def test_a_stale_index_counts_as_no_hit() -> None:
    policy = PrefixLoad(PrefixLoadParams())
    assert policy.choose(request(), [worker("a", cached=None, load=0), worker("b", cached=0, load=3)]) == 0


def test_prompts_nobody_holds_spread_evenly_over_idle_workers() -> None:
    policy = PrefixLoad(PrefixLoadParams())
    candidates = [worker(w, blocks=None) for w in "abcd"]
    picks = Counter(candidates[policy.choose(request(), candidates)].worker_id for _ in range(400))
    assert set(picks.values()) == {100}


def test_ties_go_to_the_least_loaded_worker() -> None:
    policy = PrefixLoad(PrefixLoadParams(tie_tolerance=0.2))
    candidates = [worker("a", cached=900, load=2), worker("b", cached=960, load=1), worker("c", load=0)]
    assert policy.choose(request(), candidates) == 1  # a and b tie on score; b is less loaded


@given(
    st.lists(
        st.tuples(st.none() | st.integers(0, 2000), st.integers(0, 100), st.integers(0, 100)),
        min_size=1,
        max_size=8,
    ),
    st.integers(0, 2000),
)
def test_every_choice_is_an_eligible_candidate_with_the_best_score_within_the_tolerance(
    specs: list[tuple[int | None, int, int]], num_prompt_tokens: int
) -> None:
    policy = PrefixLoad(PrefixLoadParams())
    candidates = [worker(f"w{i}", cached=c, load=load, free=free) for i, (c, load, free) in enumerate(specs)]
    route = request(num_prompt_tokens)
    chosen = policy.choose(route, candidates)
    min_load = min(w.num_load for w in candidates)
    assert 0 <= chosen < len(candidates) and not policy.is_overloaded(candidates[chosen], min_load)
    eligible = [w for w in candidates if not policy.is_overloaded(w, min_load)]
    best = max(policy.score(route, w) for w in eligible)
    assert policy.score(route, candidates[chosen]) >= best - policy.params.tie_tolerance
    assert set(policy.scores) == {w.worker_id for w in candidates}
