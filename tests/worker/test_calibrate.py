"""The step floor a worker measures at start, on the mock engine (whose steps cost what it is told)."""

from __future__ import annotations

import pytest

from policies.budget import SloBudget, SloBudgetParams
from policies.feasibility import FEASIBILITY_PROMPT_TOKENS
from wire.sampling import SamplingParams
from worker.calibrate import NUM_DECODE_STEPS, measure_step_floor
from worker.config import EngineConfig
from worker.mock import MockCost, MockRunner, build_mock_engine
from worker.policy_set import WorkerPolicies


def test_the_floor_is_what_a_decode_and_a_prefill_cost_alone_and_the_engine_is_left_idle() -> None:
    # 8 ms a step + 0.02 ms a token: a decode ~8 ms, the 512-token prefill ~18 ms (~0.036 ms/token).
    policies = WorkerPolicies.tiered()
    engine = build_mock_engine(
        EngineConfig(model="mock"), MockCost(fixed_ms=8.0, per_token_ms=0.02), policies=policies
    )
    floor = measure_step_floor(engine)
    assert floor.decode_ms == pytest.approx(8.0, rel=0.5)
    prefill_ms = 8.0 + 0.02 * FEASIBILITY_PROMPT_TOKENS
    assert floor.prefill_ms_per_token * FEASIBILITY_PROMPT_TOKENS == pytest.approx(prefill_ms, rel=0.5)
    assert not engine.has_unfinished() and engine.scheduler.num_unfinished == 0
    budget = policies.budget
    assert isinstance(budget, SloBudget)
    assert budget.model.cost.fixed_ms != 10.0  # the budget learnt from those steps, as from any
    # The calibration prompt's blocks are salted: a request of the same tokens gets no prefix hit.
    vocab = engine.model_config.vocab_size
    prompt = [3 + (7 * i + 1) % (vocab - 3) for i in range(FEASIBILITY_PROMPT_TOKENS)]
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    (output,) = [o for o in engine.step() if o.new_token_ids]
    assert output.num_cached_tokens == 0


def test_the_prefill_is_one_step_even_where_the_budget_would_chunk_it() -> None:
    # An assumed TTFT of 10 ms caps idle steps at 2 ms: the worker's steps would cut the prompt into
    # 16-token chunks, each paying the fixed cost. Calibration runs at the ceilings (3 steps for the
    # warm-up, 1 for the prefill, the decodes), and the budget still learns from every one.
    policies = WorkerPolicies.tiered()
    budget = policies.budget = SloBudget(SloBudgetParams(assumed_ttft_ms=10.0))
    prior = budget.model.cost
    engine = build_mock_engine(
        EngineConfig(model="mock"), MockCost(fixed_ms=2.0, per_token_ms=0.01), policies=policies
    )
    assert isinstance(engine.runner, MockRunner)
    measure_step_floor(engine)
    assert engine.runner.num_steps == 3 + 1 + NUM_DECODE_STEPS
    assert policies.budget is budget and budget.model.cost != prior
