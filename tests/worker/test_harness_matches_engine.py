"""The policy harness (``tierserve.testing``) and the engine make the same decisions on the same trace.

The same requests go through ``simulate`` and through an Engine over the mock runner, with the same
policies, limits, block size and KV capacity (small enough to preempt): every step schedules the same
tokens of the same requests and preempts the same ones, and every request emits as many tokens. The
policies here read no clock (the engine's is real, the harness's simulated), and every request
arrives at time 0 on both sides.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from policies.base import NoParams
from policies.budget import Static
from policies.eviction import Lru
from policies.ordering import Fcfs, Tiered, TieredParams
from policies.preemption import LowestTier, Newest
from tierserve.testing import SimConfig, SimRequest, simulate
from wire.sampling import SamplingParams
from wire.tier import DEFAULT_TIERS
from worker.config import EngineConfig
from worker.mock import build_mock_engine
from worker.policy_set import WorkerPolicies
from worker.request import TierRef
from worker.scheduler import SchedulerOutput
from worker.tracing import NullObserver

BLOCK_SIZE, NUM_BLOCKS, MAX_TOKENS, MAX_SEQS = 16, 12, 64, 6
LENGTHS = [(40, 30), (9, 50), (70, 12), (16, 40), (33, 33), (5, 60), (90, 8), (21, 45)]


def trace() -> list[SimRequest]:
    return [
        SimRequest(f"r{i}", 0.0, DEFAULT_TIERS[i % 3], prompt, output)
        for i, (prompt, output) in enumerate(LENGTHS)
    ]


class Recorder(NullObserver):
    def __init__(self) -> None:
        self.steps: list[tuple[dict[str, int], tuple[str, ...]]] = []

    def on_schedule(self, out: SchedulerOutput) -> None:
        self.steps.append((dict(out.num_scheduled_tokens), tuple(r.request_id for r in out.preempted)))


def baseline() -> WorkerPolicies:
    return WorkerPolicies(Fcfs(NoParams()), Static(NoParams()), Newest(NoParams()), Lru(NoParams()))


def tiered() -> WorkerPolicies:
    return WorkerPolicies(Tiered(TieredParams()), Static(NoParams()), LowestTier(NoParams()), Lru(NoParams()))


@pytest.mark.parametrize("make_policies", [baseline, tiered])
def test_the_harness_and_the_engine_make_the_same_decisions(
    make_policies: Callable[[], WorkerPolicies],
) -> None:
    specs = trace()
    policies = make_policies()
    config = SimConfig(
        max_num_batched_tokens=MAX_TOKENS,
        max_num_seqs=MAX_SEQS,
        kv_capacity_tokens=NUM_BLOCKS * BLOCK_SIZE,
        block_size=BLOCK_SIZE,
    )
    result = simulate(
        specs,
        ordering=policies.ordering,
        budget=policies.budget,
        preemption=policies.preemption,
        config=config,
    )
    simulated = [(s.num_scheduled_tokens, s.preempted) for s in result.steps if s.num_scheduled_tokens]
    assert result.num_preemptions > 0  # the trace exercises preemption

    engine_config = EngineConfig(
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=MAX_TOKENS,
        max_num_seqs=MAX_SEQS,
        enable_prefix_caching=False,
        num_kv_blocks=NUM_BLOCKS,
    )
    engine = build_mock_engine(engine_config, policies=make_policies())
    recorder = Recorder()
    engine.observer = recorder
    for i, spec in enumerate(specs):
        prompt = [3 + (7 * i + t) % 250 for t in range(spec.num_prompt_tokens)]  # the cache is off
        params = SamplingParams(max_tokens=spec.num_output_tokens, ignore_eos=True, temperature=0.0)
        tier = TierRef(spec.tier.name, spec.tier.rank, spec.tier.ttft_ms, spec.tier.tpot_ms)
        engine.add_request(prompt, params, request_id=spec.request_id, tier=tier)
    for request in engine.scheduler.requests.values():
        request.arrival_time = 0.0  # as in the trace (the engine stamps its own clock)
    emitted = {spec.request_id: 0 for spec in specs}
    while engine.has_unfinished():
        for output in engine.step():
            emitted[output.request_id] += len(output.new_token_ids)

    assert recorder.steps == simulated
    assert emitted == {r.request_id: len(r.token_times) for r in result.requests.values()}
