"""A scored prompt (``prompt_logprobs``): each prompt token's logprob given the tokens before it, on a
tiny random-weight Llama in float32, against Hugging Face's teacher-forced forward; the same whatever
the chunking, the batch and the prefix cache; ``max_tokens`` 0 scores and generates nothing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from wire.errors import InvalidRequestError
from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import Engine
from worker.outputs import Completion
from worker.request import SCORE_CHUNK_TOKENS, FinishReason

pytestmark = pytest.mark.isa

TOP = 4


def _vocab(folder: Path) -> int:
    return len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])


def _prompts(folder: Path) -> list[list[int]]:
    rng = random.Random(11)
    vocab = _vocab(folder)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    return [
        [rng.randrange(3, vocab) for _ in range(2)],
        shared + [rng.randrange(3, vocab) for _ in range(9)],
        shared + [rng.randrange(3, vocab) for _ in range(150)],
    ]


def hf_prompt_logprobs(folder: Path, ids: list[int]) -> tuple[list[float], list[list[int]], list[int]]:
    """Hugging Face's logprob of each prompt token after the first, the top-``TOP`` ids there and the
    token's rank."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    return chosen.squeeze(1).tolist(), logprobs.topk(TOP, dim=-1).indices.tolist(), ranks


def _engine(folder: Path, **config: object) -> Engine:
    return Engine.from_config(
        EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=96, max_model_len=256, **config)  # type: ignore[arg-type]
    )


def _scored(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)


def _flat(done: Completion) -> tuple[list[int], list[float], list[list[int]]]:
    entries = done.prompt_logprobs
    return (
        [e.token_id for e in entries],
        [e.logprob for e in entries],
        [[t for t, _ in e.top] for e in entries],
    )


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["fused", "torch"])
def test_prompt_logprobs_equal_hugging_face_teacher_forced(tiny_model: Path, cpu_kernels: bool) -> None:
    engine = _engine(tiny_model, cpu_kernels=cpu_kernels)
    prompts = _prompts(tiny_model)
    results = engine.generate(prompts, _scored(0))
    for ids, done in zip(prompts, results, strict=True):
        assert done.token_ids == [] and done.finish_reason is FinishReason.LENGTH
        targets, values, tops = _flat(done)
        assert targets == ids[1:]
        want, want_tops, want_ranks = hf_prompt_logprobs(tiny_model, ids)
        torch.testing.assert_close(torch.tensor(values), torch.tensor(want), atol=2e-5, rtol=1e-5)
        ranks = [e.rank for e in done.prompt_logprobs]
        assert sum(r != w for r, w in zip(ranks, want_ranks, strict=True)) <= 1  # a near-tie may swap
        for entry, top, hf_top in zip(done.prompt_logprobs, tops, want_tops, strict=True):
            assert top[0] == hf_top[0] or abs(entry.top[0][1] - entry.top[1][1]) < 1e-5
            assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
    engine.scheduler.check_integrity()


def test_chunks_batches_and_the_prefix_cache_change_nothing(tiny_model: Path) -> None:
    prompts = _prompts(tiny_model)
    alone = [_engine(tiny_model).generate([ids], _scored(3))[0] for ids in prompts]

    # chunks of 32 tokens, every prompt's blocks cached by a plain request first, and all together
    engine = _engine(tiny_model, max_num_batched_tokens=32)
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, plain)[2].num_cached_tokens >= 16  # the shared prefix: a hit
    together = engine.generate(prompts, _scored(3))
    for one, other, ids in zip(alone, together, prompts, strict=True):
        assert other.num_cached_tokens == 0  # a scored prompt reads nothing from the cache
        assert len(other.prompt_logprobs) == len(ids) - 1
        assert _flat(other)[0] == _flat(one)[0] and _flat(other)[2] == _flat(one)[2]
        torch.testing.assert_close(
            torch.tensor(_flat(other)[1]), torch.tensor(_flat(one)[1]), atol=1e-6, rtol=0
        )
        assert other.token_ids == one.token_ids  # and the answer is the answer without scoring
    assert [c.token_ids for c in engine.generate(prompts, plain)] == [c.token_ids for c in together]
    engine.scheduler.check_integrity()


def test_a_scored_prompt_goes_out_a_chunk_at_a_time_before_its_first_token(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("worker.scheduler.SCORE_CHUNK_TOKENS", 64)  # the tiny model's context is 256
    engine = _engine(tiny_model, max_num_batched_tokens=512)
    ids = _prompts(tiny_model)[2]  # 190 tokens: chunks of 64, 64 and 62
    engine.add_request(ids, _scored(2), request_id="r")
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == "r"]
    got = [(o.prompt_position, len(o.prompt_logprobs), len(o.new_token_ids)) for o in outputs]
    assert got == [(1, 64, 0), (65, 64, 0), (129, 61, 1), (0, 0, 1)]
    assert [e.token_id for o in outputs for e in o.prompt_logprobs] == ids[1:]
    assert SCORE_CHUNK_TOKENS >= 64


def test_max_tokens_zero_needs_a_scored_prompt() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(max_tokens=0).validate(vocab_size=100, max_model_len=64, num_prompt_tokens=4)
    assert raised.value.field == "max_tokens"
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate(
        vocab_size=100, max_model_len=64, num_prompt_tokens=4
    )
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(prompt_logprobs=21).validate(vocab_size=100, max_model_len=64, num_prompt_tokens=4)
    assert raised.value.field == "prompt_logprobs"
