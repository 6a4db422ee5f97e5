"""The worker's floor, measured once at start: a one-decode step and a prefill, each alone.

Run through the engine's real step (so the budget policy learns from these steps as from any, but
does not size them: the prefill is one step up to ``max_num_batched_tokens``, not chunks under a
time limit whose fixed costs would count as the prompt's), on a request of
``FEASIBILITY_PROMPT_TOKENS`` token ids under a salt of its own (its blocks never serve anyone's
prefix), after a short warm-up. What it finds goes to the gateway in Register
(policies/feasibility.py says what is made of it) and into ``$TIERSERVE_CACHE/.step_floors/`` for
``tierserve config show``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

from policies.base import BudgetPolicy, SeqView, StepBudget, StepLimits, StepReport
from policies.feasibility import FEASIBILITY_PROMPT_TOKENS, StepFloor
from wire.sampling import SamplingParams
from worker.engine import Engine
from worker.request import TierRef

log = logging.getLogger(__name__)

NUM_DECODE_STEPS = 12
SALT = "tierserve-calibration"


def measure_step_floor(engine: Engine, num_prompt_tokens: int = FEASIBILITY_PROMPT_TOKENS) -> StepFloor:
    """Time a prefill of ``num_prompt_tokens`` and ``NUM_DECODE_STEPS`` decodes of one request alone
    (after a warm-up request); the engine must be idle."""
    assert not engine.has_unfinished(), "calibrate an idle engine"
    vocab = engine.model_config.vocab_size
    num_prompt_tokens = max(1, min(num_prompt_tokens, engine.max_model_len - NUM_DECODE_STEPS - 2))
    with _steps_at_the_ceilings(engine):
        _run(engine, [3 + i % (vocab - 3) for i in range(16)], 2)  # warm-up: first-call costs
        prompt = [3 + (7 * i + 1) % (vocab - 3) for i in range(num_prompt_tokens)]
        prefill_ms, decode_ms = _run(engine, prompt, NUM_DECODE_STEPS)
    floor = StepFloor(
        decode_ms=statistics.median(decode_ms) if decode_ms else prefill_ms,
        prefill_ms_per_token=prefill_ms / num_prompt_tokens,
    )
    log.info(
        "step floor: one decode alone %.1f ms; a %d-token prefill %.0f ms (%.2f ms/token)",
        floor.decode_ms, num_prompt_tokens, prefill_ms, floor.prefill_ms_per_token,
    )  # fmt: skip
    return floor


class _Ceilings:
    """A budget policy that gives every step the engine's ceilings and passes what it sees on to
    ``learner`` (the worker's own budget policy, which goes on learning the step cost)."""

    kind: ClassVar[str] = "budget"

    def __init__(self, learner: BudgetPolicy) -> None:
        self.learner = learner

    def budget(
        self, running: Sequence[SeqView], waiting: Sequence[SeqView], limits: StepLimits
    ) -> StepBudget:
        return StepBudget(limits.max_num_batched_tokens, limits.max_num_seqs)

    def observe(self, report: StepReport) -> None:
        self.learner.observe(report)


@contextmanager
def _steps_at_the_ceilings(engine: Engine) -> Iterator[None]:
    policies = engine.scheduler.policies
    learner = policies.budget
    policies.budget = _Ceilings(learner)
    try:
        yield
    finally:
        policies.budget = learner


def _run(engine: Engine, prompt: list[int], num_decodes: int) -> tuple[float, list[float]]:
    """(the prefill's time, each decode step's time) in ms for one request run alone."""
    params = SamplingParams(max_tokens=num_decodes + 1, temperature=0.0, ignore_eos=True)
    request_id = engine.add_request(prompt, params, tier=TierRef("calibration", 0), cache_salt=SALT)
    prefill_ms = 0.0
    decode_ms: list[float] = []
    has_first_token = False
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = (time.perf_counter() - start) * 1e3
        if has_first_token:
            decode_ms.append(elapsed)
        else:  # every chunk of the prompt, up to the step that gave the first token
            prefill_ms += elapsed
            has_first_token = any(o.request_id == request_id and o.new_token_ids for o in outputs)
    return prefill_ms, decode_ms
