"""A request's logits do not depend on what it is batched with (the real model, in-process).

The embedded SmolLM2 as served (its Q4_1 GGUF) and in float32, through the fused C layer on this
CPU's path (the ``TIERSERVE_CPU_ISA=avx2`` pass of ``make test`` runs the AVX2 builds): one seeded,
sampled request alone, then in crowds that cut its steps differently. Its tokens and its top
logprobs must be the same bits each time: a seed reproduces an answer whatever else the server is
doing. The decode rows' RMS norm once summed in a different order for the first row of a step than
for the rest (an ``omp simd`` reduction that GCC compiled twice), and the Q4_1 default's logits
moved by up to ~0.03 with the batch; a prompt's rows attended in tiles or row by row by how its step
was cut.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import Engine
from worker.models.store import pull_default_model

pytestmark = [pytest.mark.slow, pytest.mark.isa]

TARGET = "Write a short poem about the sea."
OTHERS = [
    "Describe the water cycle in detail.",
    "Explain how a bicycle gear works, step by step. " * 3,
    "Write about the history of the printing press.",
    "What should I pack for a week of hiking? " * 2,
    "Invent a recipe with apples and cheese.",
    "Name three rivers.",
]
# KV blocks of 16 tokens: all seven prompts fit, their answers not (20 blocks: the target waits
# instead of running; 24 to 28 preempt it)
NUM_KV = 26
SAMPLED = SamplingParams(
    max_tokens=16, temperature=1.0, top_p=0.95, presence_penalty=0.3, seed=11, ignore_eos=True, logprobs=3
)


Answer = list[tuple[int, list[tuple[int, float]]]]  # each token, with its top logprobs


def answer(engine: Engine, crowd: list[str], *, one_a_step: bool, preempted: bool = False) -> Answer:
    """The target's tokens, each with its top logprobs, beside ``crowd`` (unseeded, sampled), which
    arrives after it: one a step or all at once. ``preempted``: the crowd arrives first instead, so
    that the target is the newest (the first the default policy preempts), and it must be."""
    others = SamplingParams(max_tokens=16, temperature=0.8, top_k=40, ignore_eos=True)
    got: Answer = []

    def add(text: str, params: SamplingParams) -> str:
        return engine.add_request(engine.apply_chat_template([{"role": "user", "content": text}]), params)

    def step() -> None:
        for output in engine.step():
            if output.request_id == target:
                got.extend((t, lp.top) for t, lp in zip(output.new_token_ids, output.logprobs, strict=True))

    for text in crowd if preempted else []:
        add(text, others)
    target = add(TARGET, SAMPLED)
    request = engine.scheduler.requests[target]
    for text in [] if preempted else crowd:
        if one_a_step:
            step()
        add(text, others)
    while engine.has_unfinished():
        step()
    engine.scheduler.check_integrity()
    assert (request.num_preemptions > 0) == preempted
    return got


@pytest.mark.parametrize("weights", ["q4_1", "float32"])
def test_a_seeded_answer_is_the_same_bits_alone_and_in_a_crowd(weights: str) -> None:
    """Beside six others arriving one a step (its decodes beside their prompts' prefills), all at once
    (its prompt in one step with theirs, in slices where the build slices), its prompt's cached blocks
    reused (only the prompt's tail computed), in an engine whose token budget cuts its prompt, and
    preempted by a cache too small for the crowd (its output tokens recomputed)."""
    config = engine_config(weights)
    engine = fused_engine(dataclasses.replace(config, enable_prefix_caching=False))
    alone = answer(engine, [], one_a_step=False)
    assert len(alone) == SAMPLED.max_tokens
    assert answer(engine, OTHERS, one_a_step=True) == alone
    assert answer(engine, OTHERS, one_a_step=False) == alone
    cached = Engine.from_config(config)
    assert answer(cached, [], one_a_step=False) == alone
    assert answer(cached, OTHERS, one_a_step=False) == alone
    assert cached.kv_cache.num_prefix_hits > 0
    budget = Engine.from_config(dataclasses.replace(config, max_num_batched_tokens=24))
    assert answer(budget, OTHERS, one_a_step=True) == alone
    small = Engine.from_config(dataclasses.replace(config, enable_prefix_caching=False, num_kv_blocks=NUM_KV))
    assert answer(small, OTHERS, one_a_step=False, preempted=True) == alone  # recomputed, the same


def engine_config(weights: str) -> EngineConfig:
    config = EngineConfig()
    if weights == "float32":
        config = dataclasses.replace(config, model=str(pull_default_model()), dtype="float32")
    return config


def fused_engine(config: EngineConfig) -> Engine:
    engine = Engine.from_config(config)
    if engine.runner.decode_step is None:
        pytest.skip("no fused C layer on this machine (the torch path is not batch-invariant)")
    return engine


def greedy(
    engine: Engine, prompt: list[int], max_tokens: int, seen: Sequence[int] = (), penalty: float = 0.0
) -> Answer:
    """A greedy answer's tokens with their top logprobs (``seen``: as the engine's add_request;
    ``penalty``: presence and frequency)."""
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        logprobs=3,
        presence_penalty=penalty,
        frequency_penalty=penalty,
    )
    request_id = engine.add_request(prompt, params, seen_token_ids=seen)
    got: Answer = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id:
                got.extend((t, lp.top) for t, lp in zip(output.new_token_ids, output.logprobs, strict=True))
    return got


@pytest.mark.parametrize("weights", ["q4_1", "float32"])
def test_a_follow_up_holding_a_cached_answer_is_the_same_bits_as_uncached(weights: str) -> None:
    """A chat's next turn: the first answer's tokens are in the follow-up's prompt. Their K/V were
    cached by decode rows, which attend alone; computed in the prompt they attend in tiles, with other
    bits (the Q4_1 default's logprobs moved by ~0.002). So the follow-up hits the first prompt's
    blocks only, and answers as on an engine that cached nothing."""
    config = engine_config(weights)
    cached = fused_engine(config)
    first = cached.apply_chat_template([{"role": "user", "content": TARGET}])
    follow_up = [*first, *(token for token, _ in greedy(cached, first, 32)), *first[-8:]]
    hits_before = cached.kv_cache.num_prefix_hits
    again = greedy(cached, follow_up, 32)
    fresh = Engine.from_config(dataclasses.replace(config, enable_prefix_caching=False))
    assert again == greedy(fresh, follow_up, 32)
    assert 0 < cached.kv_cache.num_prefix_hits - hits_before <= len(first)


@pytest.mark.parametrize("weights", ["q4_1", "float32"])
def test_a_failover_continuation_is_the_same_bits(weights: str) -> None:
    """A worker that takes over a request gets the tokens the client has seen appended to the prompt
    (``seen_token_ids``); it computes them as the output rows they were on the first worker (prompt
    rows would give other bits), and its penalties count them as output, so the rest of the answer is
    what the first worker would have sent."""
    config = dataclasses.replace(engine_config(weights), enable_prefix_caching=False)
    first = fused_engine(config)
    prompt = first.apply_chat_template([{"role": "user", "content": TARGET}])
    whole = greedy(first, prompt, 40, penalty=0.4)
    seen = [token for token, _ in whole[:20]]
    assert greedy(Engine.from_config(config), [*prompt, *seen], 20, seen, penalty=0.4) == whole[20:]
