"""The scheduler without a model: steps are simulated by appending a token per finished prefill."""

from __future__ import annotations

import random

from policies.base import StepBudget, StepLimits, StepReport
from policies.step_time import StepCost, StepTimeLimit
from wire.sampling import SamplingParams
from worker.kv_cache import KVCacheManager
from worker.policy_set import WorkerPolicies
from worker.request import FinishReason, Request, RequestStatus, TierRef
from worker.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, max_seqs), KVCacheManager(num_blocks, 4))


def make_request(request_id: str, num_prompt: int, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    prompt = [hash((request_id, i)) % 100 for i in range(num_prompt)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=arrival)


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """What the engine does around the runner: advance, sample a token, finish at max_tokens."""
    out = scheduler.schedule()
    for request in scheduler.postprocess(out):
        request.append_output_token(len(request.output_token_ids) % 100)
        if request.num_output_tokens >= request.sampling_params.max_tokens:
            scheduler.finish(request.request_id, FinishReason.LENGTH)
    scheduler.check_integrity()
    return out


def test_long_prompt_is_chunked_and_mixed_with_decodes() -> None:
    scheduler = make_scheduler(budget=16)
    scheduler.add(make_request("short", 3, max_tokens=10, arrival=0))
    run_step(scheduler)  # prefill of "short"
    scheduler.add(make_request("long", 40, arrival=1))
    out = run_step(scheduler)
    assert out.num_scheduled_tokens == {"short": 1, "long": 15}
    assert [r.request_id for r in out.scheduled] == ["short", "long"]  # decodes first
    out = run_step(scheduler)
    assert out.num_scheduled_tokens == {"short": 1, "long": 15}
    out = run_step(scheduler)
    assert out.num_scheduled_tokens == {"short": 1, "long": 10}
    assert scheduler.requests["long"].num_output_tokens == 1


def test_budget_and_max_num_seqs_are_respected() -> None:
    scheduler = make_scheduler(budget=20, max_seqs=3)
    for i in range(6):
        scheduler.add(make_request(f"r{i}", 8, arrival=i))
    while scheduler.num_unfinished:
        out = run_step(scheduler)
        assert out.total_num_tokens <= 20
        assert len(scheduler.running) <= 3


def test_preemption_frees_blocks_and_everyone_finishes() -> None:
    # 10 blocks of 4 tokens: three 12-token prompts growing by 8 tokens cannot all fit.
    scheduler = make_scheduler(num_blocks=10, budget=64)
    for i in range(3):
        scheduler.add(make_request(f"r{i}", 12, max_tokens=8, arrival=i))
    outputs = {}
    steps = 0
    while scheduler.num_unfinished:
        out = run_step(scheduler)
        steps += 1
        assert steps < 200
        for request in out.preempted:
            assert request.block_ids == [] and request.num_computed_tokens == 0
            assert request.status is RequestStatus.PREEMPTED
        for request in out.scheduled:
            outputs[request.request_id] = request
    assert scheduler.num_preemptions > 0
    assert all(r.output_token_ids == list(range(8)) for r in outputs.values())
    assert all(r.finish_reason is FinishReason.LENGTH for r in outputs.values())
    _, in_use, _ = scheduler.kv_cache.pool.counts()
    assert in_use == 0


def test_newest_is_preempted_first() -> None:
    scheduler = make_scheduler(num_blocks=8, budget=64)
    scheduler.add(make_request("old", 14, max_tokens=16, arrival=0))
    scheduler.add(make_request("new", 14, max_tokens=16, arrival=1))
    preempted: list[str] = []
    while scheduler.num_unfinished:
        out = run_step(scheduler)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and preempted[0] == "new"
    # Even when "new" is the one short of a block, it gives way rather than evicting "old".
    assert "old" not in preempted


def test_prefix_hit_skips_computed_tokens() -> None:
    scheduler = make_scheduler()
    first = make_request("a", 18, max_tokens=1)
    scheduler.add(first)
    run_step(scheduler)
    second = Request("b", list(first.prompt_token_ids), SamplingParams(max_tokens=1))
    scheduler.add(second)
    out = run_step(scheduler)
    assert second.num_cached_tokens == 16
    assert out.num_scheduled_tokens == {"b": 2}


def test_abort_of_waiting_and_running_requests() -> None:
    scheduler = make_scheduler(max_seqs=1)
    scheduler.add(make_request("a", 5, max_tokens=50))
    scheduler.add(make_request("b", 5))
    run_step(scheduler)
    assert scheduler.finish("a", FinishReason.ABORT) is not None
    assert scheduler.finish("b", FinishReason.ABORT) is not None
    assert scheduler.finish("b", FinishReason.ABORT) is None
    assert scheduler.num_unfinished == 0 and scheduler.schedule().is_empty
    assert scheduler.kv_cache.pool.counts()[1] == 0


def test_random_workloads_keep_invariants() -> None:
    rng = random.Random(0)
    for trial in range(20):
        scheduler = make_scheduler(num_blocks=rng.randint(8, 40), budget=rng.randint(4, 64), max_seqs=4)
        for i in range(rng.randint(1, 10)):
            scheduler.add(make_request(f"{trial}-{i}", rng.randint(1, 20), rng.randint(1, 10), arrival=i))
        steps = 0
        while scheduler.num_unfinished:
            run_step(scheduler)
            steps += 1
            assert steps < 2000, "scheduler made no progress"


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=64)
    request = make_request("a", 18, max_tokens=8)
    scheduler.add(request)
    run_step(scheduler)
    scheduler._preempt(request, SchedulerOutput())
    scheduler.running.remove(request)
    out = run_step(scheduler)
    # 19 tokens (18 prompt + 1 output): 4 full blocks were cached, only the tail is recomputed.
    assert out.num_scheduled_tokens == {"a": 3}
    for _ in range(4):  # to 24 tokens, 23 computed: 5 full blocks, the fifth holding its first outputs
        run_step(scheduler)
    scheduler._preempt(request, SchedulerOutput())
    scheduler.running.remove(request)
    out = run_step(scheduler)
    # The fifth is a hit too (its outputs' chain is marked, and it is theirs): 4 tokens, not 8.
    assert out.num_scheduled_tokens == {"a": 4}
    assert request.num_preemptions == 2


def test_a_later_prompt_holding_an_answer_hits_only_the_answers_prompt_blocks() -> None:
    """An answer's K/V were computed as decode rows: a follow-up whose prompt holds the answer computes
    it again, as prompt rows (the same bits whether its history was cached or not)."""
    scheduler = make_scheduler(budget=64)
    first = make_request("a", 18, max_tokens=12)
    scheduler.add(first)
    while scheduler.num_unfinished:
        run_step(scheduler)
    follow = Request("b", [*first.all_token_ids, 7, 7, 7], SamplingParams(max_tokens=1), arrival_time=1)
    scheduler.add(follow)
    out = run_step(scheduler)
    # 33 prompt tokens: the 4 full blocks of "a"'s prompt were hits (its answer's 3 more were not).
    assert out.num_scheduled_tokens == {"b": 33 - 16}


def test_request_short_of_a_block_preempts_itself_when_it_is_the_newest() -> None:
    scheduler = make_scheduler(num_blocks=4, budget=64)
    scheduler.add(make_request("old", 7, max_tokens=4, arrival=0))  # 2 blocks, room for 1 more token
    scheduler.add(make_request("new", 8, max_tokens=4, arrival=1))  # 2 full blocks
    run_step(scheduler)  # both prefilled; the cache is full
    out = run_step(scheduler)
    assert [r.request_id for r in out.preempted] == ["new"]
    assert out.num_scheduled_tokens == {"old": 1}


class FixedLimit:
    """A budget that caps every step at ``max_ms`` of a known cost (policies.step_time)."""

    kind = "budget"

    def __init__(self, cost: StepCost, max_ms: float) -> None:
        self.limit = StepTimeLimit(cost, max_ms)

    def budget(self, running: object, waiting: object, limits: StepLimits) -> StepBudget:
        return StepBudget(limits.max_num_batched_tokens, limits.max_num_seqs, self.limit)

    def observe(self, report: StepReport) -> None:
        pass


def limited_scheduler(max_ms: float, budget: int = 256) -> Scheduler:
    # fixed 10 ms, a decode 2 ms, a prefill token 0.5 ms, no context term
    policies = WorkerPolicies.baseline()
    policies.budget = FixedLimit(StepCost(10.0, 2.0, 0.5, 0.0), max_ms)
    return Scheduler(SchedulerConfig(budget, 16), KVCacheManager(256, 4), policies)


def test_under_a_time_limit_decodes_sit_out_and_keep_their_kv() -> None:
    scheduler = limited_scheduler(max_ms=100.0)
    for i in range(6):
        scheduler.add(make_request(f"r{i}", 4, max_tokens=8, arrival=i))
    run_step(scheduler)  # their prefills
    assert len(scheduler.running) == 6
    budget = scheduler.policies.budget
    assert isinstance(budget, FixedLimit)
    budget.limit = StepTimeLimit(budget.limit.cost, 18.0)  # 10 fixed + four 2 ms decodes
    out = run_step(scheduler)
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1", "r2", "r3"]  # fcfs: the first four fit
    sat_out = [scheduler.requests[f"r{i}"] for i in (4, 5)]
    assert all(r.status is RequestStatus.RUNNING and r.blocks for r in sat_out)  # KV kept
    for _ in range(100):
        if not scheduler.num_unfinished:
            break
        out = run_step(scheduler)
        assert len(out.num_scheduled_tokens) <= 4
    assert not scheduler.requests


def test_under_a_time_limit_a_prefill_chunk_is_shortened_to_fit() -> None:
    scheduler = limited_scheduler(max_ms=30.0)
    scheduler.add(make_request("decoding", 4, max_tokens=20, arrival=0))
    run_step(scheduler)
    scheduler.add(make_request("long", 200, arrival=1))
    out = run_step(scheduler)
    # 10 fixed + 2 for the decode leaves 18 ms: 36 prefill tokens.
    assert out.num_scheduled_tokens == {"decoding": 1, "long": 36}
    # The step's first request always runs, its chunk cut to the limit too: 50 ms after the fixed
    # 10 is 100 tokens; a limit below even the fixed cost still gets the minimum chunk (16).
    scheduler = limited_scheduler(max_ms=60.0)
    scheduler.add(make_request("alone", 200))
    assert run_step(scheduler).num_scheduled_tokens == {"alone": 100}
    scheduler = limited_scheduler(max_ms=5.0)
    scheduler.add(make_request("alone", 200))
    assert run_step(scheduler).num_scheduled_tokens == {"alone": 16}


def test_a_step_lengthened_for_one_first_token_is_not_spent_on_the_prefill_before_it() -> None:
    # fcfs: "early" (200 tokens) comes first; the step is 40 ms, lengthened to 140 ms for "due"'s
    # first token (100 tokens: 50 ms). early's chunk stops at 40 ms (10 fixed + 30 ms: 60 tokens),
    # and due's whole prompt fits in the 140.
    scheduler = limited_scheduler(max_ms=40.0)
    budget = scheduler.policies.budget
    assert isinstance(budget, FixedLimit)
    budget.limit = StepTimeLimit(budget.limit.cost, 40.0, {"due": 140.0})
    scheduler.add(make_request("early", 200, arrival=0))
    scheduler.add(make_request("due", 100, arrival=1))
    scheduler.add(make_request("late", 200, arrival=2))
    # What due leaves of the 140 ms is anyone's after it: late's chunk fills the ~50 ms left.
    scheduled = run_step(scheduler).num_scheduled_tokens
    assert (scheduled["early"], scheduled["due"]) == (60, 100) and 90 <= scheduled["late"] <= 100
    # Without the name, early's whole prompt (110 ms) goes first and due gets a chunk of the rest.
    scheduler = limited_scheduler(max_ms=140.0)
    scheduler.add(make_request("early", 200, arrival=0))
    scheduler.add(make_request("due", 100, arrival=1))
    scheduled = run_step(scheduler).num_scheduled_tokens
    assert scheduled["early"] == 200 and scheduled["due"] < 100


def test_a_more_urgent_request_takes_the_slot_of_a_less_urgent_one() -> None:
    policies = WorkerPolicies.tiered()
    scheduler = Scheduler(SchedulerConfig(256, 2), KVCacheManager(256, 4), policies)
    for i in range(2):
        batch = make_request(f"batch{i}", 8, max_tokens=30, arrival=i)
        batch.tier = TierRef("batch", 2)
        scheduler.add(batch)
    run_step(scheduler)
    urgent = make_request("urgent", 8, max_tokens=3, arrival=5)
    urgent.tier = TierRef("interactive", 0, ttft_ms=1000.0, tpot_ms=100.0)
    scheduler.add(urgent)
    out = run_step(scheduler)
    assert "urgent" in out.num_scheduled_tokens
    assert [r.request_id for r in out.preempted] == ["batch1"]  # lowest-tier: the later of equals
    assert scheduler.requests["batch1"].status is RequestStatus.PREEMPTED
    while scheduler.num_unfinished:
        run_step(scheduler)
    # The baseline (newest) never preempts for a slot on an arrival's behalf: it waits.
    scheduler = Scheduler(SchedulerConfig(256, 1), KVCacheManager(256, 4))
    batch = make_request("batch", 8, max_tokens=5)
    batch.tier = TierRef("batch", 2)
    scheduler.add(batch)
    run_step(scheduler)
    urgent = make_request("urgent", 8, max_tokens=3, arrival=5)
    urgent.tier = TierRef("interactive", 0)
    scheduler.add(urgent)
    out = run_step(scheduler)
    assert out.num_scheduled_tokens == {"batch": 1} and not out.preempted


def test_a_more_urgent_request_takes_the_blocks_of_a_less_urgent_one() -> None:
    # 10 blocks of 4 tokens: two batch requests hold 8 of them; the urgent one needs 3 for its prompt.
    scheduler = Scheduler(SchedulerConfig(256, 8), KVCacheManager(10, 4), WorkerPolicies.tiered())
    for i in range(2):
        batch = make_request(f"batch{i}", 15, max_tokens=20, arrival=i)
        batch.tier = TierRef("batch", 2)
        scheduler.add(batch)
    run_step(scheduler)
    urgent = make_request("urgent", 12, max_tokens=2, arrival=5)
    urgent.tier = TierRef("interactive", 0)
    scheduler.add(urgent)
    out = run_step(scheduler)
    assert "urgent" in out.num_scheduled_tokens and [r.request_id for r in out.preempted] == ["batch1"]
    for _ in range(200):
        if not scheduler.num_unfinished:
            break
        run_step(scheduler)
    assert not scheduler.requests  # the victim was recomputed and finished


def test_a_light_tenant_takes_a_slot_of_a_heavy_one_of_its_tier_and_never_gives_it_back() -> None:
    # Two slots, both heavy's; light's arrival takes the one with the least progress (lowest-tier),
    # which runs again once light is done. Under fcfs light waits.
    for policies, takes in ((WorkerPolicies.tiered(), True), (WorkerPolicies.baseline(), False)):
        scheduler = Scheduler(SchedulerConfig(256, 2), KVCacheManager(256, 4), policies)
        for i, prompt in enumerate((12, 8)):
            heavy = make_request(f"heavy{i}", prompt, max_tokens=20, arrival=i)
            heavy.tenant = "heavy"
            scheduler.add(heavy)
        run_step(scheduler)
        light = make_request("light", 8, max_tokens=3, arrival=5)
        light.tenant = "light"
        scheduler.add(light)
        out = run_step(scheduler)
        assert ("light" in out.num_scheduled_tokens) is takes
        assert [r.request_id for r in out.preempted] == (["heavy1"] if takes else [])
        # Heavy at its share (1 of 2) cannot take the slot back while light runs.
        for _ in range(2):
            out = run_step(scheduler)
            assert not out.preempted
        while scheduler.num_unfinished:
            run_step(scheduler)
        assert scheduler.num_preemptions == (1 if takes else 0)
