"""Routing built-ins: every choice is a candidate; least-loaded never picks a worker another candidate
beats and spreads exact ties evenly; round-robin gives each worker its turn whatever the load."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.base import NoParams
from policies.registry import load_policy
from policies.routing import LeastLoaded, RoundRobin, RouteRequest, RoutingPolicy, WorkerView

REQUEST = RouteRequest(request_id="r", model="m", tier=None, num_prompt_tokens=10)


def worker(
    worker_id: str,
    *,
    in_flight: int = 0,
    running: int | None = None,
    waiting: int | None = None,
    free: int | None = None,
    total: int | None = None,
    max_num_seqs: int = 4,
) -> WorkerView:
    return WorkerView(
        worker_id=worker_id,
        model="m",
        state="ready",
        max_num_seqs=max_num_seqs,
        num_in_flight=in_flight,
        num_running=running,
        num_waiting=waiting,
        num_free_blocks=free,
        num_total_blocks=total,
        step_time_ema_ms=5.0,
    )


workers_strategy = st.lists(
    st.builds(
        lambda i, in_flight, running, waiting, free: worker(
            f"w{i}", in_flight=in_flight, running=running, waiting=waiting, free=free, total=100
        ),
        st.integers(0, 1000),
        st.integers(0, 8),
        st.none() | st.integers(0, 8),
        st.none() | st.integers(0, 8),
        st.none() | st.integers(0, 100),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda w: w.worker_id,
)


def both() -> list[RoutingPolicy]:
    return [LeastLoaded(NoParams()), RoundRobin(NoParams())]


@given(workers_strategy, st.integers(1, 20))
def test_every_choice_is_a_candidate_and_nothing_is_changed(workers: list[WorkerView], calls: int) -> None:
    before = list(workers)
    for policy in both():
        for _ in range(calls):
            index = policy.choose(REQUEST, workers)
            assert isinstance(index, int) and 0 <= index < len(workers)
    assert workers == before


@given(workers_strategy)
def test_least_loaded_never_picks_a_worker_another_beats(workers: list[WorkerView]) -> None:
    policy = LeastLoaded(NoParams())
    best = min((w.num_load, w.kv_usage) for w in workers)
    for _ in range(len(workers)):
        chosen = workers[policy.choose(REQUEST, workers)]
        assert (chosen.num_load, chosen.kv_usage) == best


def test_least_loaded_fewest_requests_then_least_kv_our_count_beats_a_stale_report() -> None:
    policy = LeastLoaded(NoParams())
    a = worker("a", running=2, free=100, total=100)
    b = worker("b", running=1, waiting=1, free=100, total=100)
    c = worker("c", running=1, free=10, total=100)
    assert policy.choose(REQUEST, [a, b, c]) == 2  # 1 request beats 2, whatever its KV use
    d = worker("d", running=1, free=50, total=100)
    assert policy.choose(REQUEST, [c, d]) == 1  # tied on requests: 50% KV in use beats 90%
    # Two submits since an idle heartbeat: our count (2) is the load, not the report (0).
    e = worker("e", in_flight=2, running=0, waiting=0)
    assert policy.choose(REQUEST, [e, worker("f", running=1)]) == 1


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_least_loaded_exact_ties_share_evenly(n: int) -> None:
    policy = LeastLoaded(NoParams())
    idle = [worker(f"w{i}") for i in range(n)]
    picks = Counter(policy.choose(REQUEST, idle) for _ in range(n * 4))
    assert picks == {i: 4 for i in range(n)}


def rotation(policy: RoutingPolicy, candidates: Sequence[WorkerView], calls: int) -> list[str]:
    return [candidates[policy.choose(REQUEST, candidates)].worker_id for _ in range(calls)]


@given(workers_strategy, st.integers(1, 5))
def test_round_robin_gives_each_its_turn_whatever_the_load(workers: list[WorkerView], rounds: int) -> None:
    picks = rotation(RoundRobin(NoParams()), workers, rounds * len(workers))
    assert Counter(picks) == {w.worker_id: rounds for w in workers}
    # In id order, wrapping: each full round is the sorted ids.
    ordered = sorted(w.worker_id for w in workers)
    assert picks[: len(workers)] == ordered


def test_round_robin_keeps_the_turn_when_workers_leave_and_join() -> None:
    policy = RoundRobin(NoParams())
    a, b, c = worker("a"), worker("b"), worker("c")
    assert rotation(policy, [a, b, c], 2) == ["a", "b"]
    assert rotation(policy, [a, c], 1) == ["c"]  # b gone (excluded, or dead): c was next anyway
    assert rotation(policy, [c, b, a], 3) == ["a", "b", "c"]  # order of the candidates does not matter
    # Per model: another model's turn is its own.
    other = RouteRequest(request_id="x", model="other", tier=None, num_prompt_tokens=1)
    assert policy.choose(other, [worker("z"), worker("y")]) == 1


def test_worker_view_load_and_queue() -> None:
    view = worker("w", in_flight=6, running=2, waiting=1, max_num_seqs=4)
    assert view.num_load == 6  # our count is ahead of the heartbeat
    assert view.num_queued == 2  # six on a four-sequence worker: two wait, though it reported one
    assert worker("w", running=4, waiting=3).num_queued == 3
    assert worker("w").kv_usage == 0.0 and worker("w", free=25, total=100).kv_usage == 0.75


@pytest.mark.parametrize("name,cls", [("least-loaded", LeastLoaded), ("round-robin", RoundRobin)])
def test_registered_by_name(name: str, cls: type) -> None:
    policy = load_policy("routing", name)
    assert isinstance(policy, cls) and isinstance(policy, RoutingPolicy)
