"""policies.step_time: a step's cost by its composition, and the model fitted online from every step."""

from __future__ import annotations

import random

import pytest

from policies.step_time import StepCost, StepTimeModel


def test_step_cost_arithmetic() -> None:
    cost = StepCost(fixed_ms=4.0, per_decode_ms=1.0, per_prefill_token_ms=0.25, per_context_token_ms=0.01)
    assert cost.floor_ms == 5.0
    assert cost.predict(2, 100, 1000) == pytest.approx(4 + 2 + 25 + 10)
    assert cost.decode_ms(100) == pytest.approx(2.0)
    assert cost.chunk_ms(40, 60) == pytest.approx(10 + 1.0)
    # 0.25·n + 0.01·(60 + n) <= 11  →  n <= 40
    assert cost.chunk_tokens_within(11.0, 60) == 40
    assert cost.chunk_tokens_within(0.5, 60) == 0


TRUE_COST = StepCost(fixed_ms=4.0, per_decode_ms=0.6, per_prefill_token_ms=0.3, per_context_token_ms=0.002)


def fit(model: StepTimeModel, num_reports: int, *, seed: int, steady: bool = False) -> None:
    """Feed ``model`` reports of TRUE_COST with 3% noise: varied steps, or a steady decode load."""
    rng = random.Random(seed)
    for _ in range(num_reports):
        if steady:
            decodes, prefill, context = 64, 0, 32_000 + rng.randint(-64, 64)
        else:
            # as a worker sees them: mostly decode steps, some with a prefill chunk
            decodes, context = rng.randint(1, 64), rng.randint(0, 20_000)
            prefill = rng.randint(16, 1024) if rng.random() < 0.3 else 0
        elapsed = TRUE_COST.predict(decodes, prefill, context) * (1 + rng.gauss(0, 0.03))
        model.update(decodes, prefill, context, elapsed)


def test_step_time_model_converges_to_the_cost_by_composition() -> None:
    model = StepTimeModel(StepCost(10.0, 0.5, 0.5, 0.0005), forget=0.98)
    fit(model, 800, seed=3)
    cost = model.cost
    assert cost.fixed_ms == pytest.approx(4.0, abs=2.0)
    assert cost.per_decode_ms == pytest.approx(0.6, rel=0.1)
    assert cost.per_prefill_token_ms == pytest.approx(0.3, rel=0.05)
    assert cost.per_context_token_ms == pytest.approx(0.002, rel=0.1)
    for step in ((1, 0, 1000), (32, 0, 20_000), (8, 512, 30_000)):
        # 10%, or 1.5 ms for the tiniest step: with 3% noise and a ~50-step memory the intercept
        # wanders by about a millisecond.
        assert model.predict(*step) == pytest.approx(TRUE_COST.predict(*step), rel=0.1, abs=1.5)


def test_step_time_model_stays_accurate_under_a_steady_decode_load() -> None:
    model = StepTimeModel(StepCost(10.0, 0.5, 0.5, 0.0005), forget=0.98)
    fit(model, 2000, seed=3, steady=True)
    assert model.predict(64, 0, 32_000) == pytest.approx(TRUE_COST.predict(64, 0, 32_000), rel=0.1)
    fit(model, 5000, seed=4)  # and it still learns the rest afterwards (no wound-up covariance)
    assert model.predict(8, 512, 30_000) == pytest.approx(TRUE_COST.predict(8, 512, 30_000), rel=0.1)
