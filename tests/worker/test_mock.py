"""The mock worker: real engine, scheduler and KV cache over a deterministic simulated model."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import Engine
from worker.mock import (
    BOS_ID,
    EOS_ID,
    VOCAB_SIZE,
    MockCost,
    MockModel,
    MockRunner,
    MockTokenizer,
    build_mock_engine,
)
from worker.request import FinishReason, TierRef

GREEDY = SamplingParams(max_tokens=48, temperature=0.0)
TOKENIZER = MockTokenizer()


def chat(text: str) -> list[int]:
    ids = TOKENIZER.apply_chat_template([{"role": "user", "content": text}])
    assert isinstance(ids, list)
    return ids


PROMPTS: list[str | list[int]] = [
    chat("Say hi."),
    chat("Name three rivers. " * 7),
    "héllo wörld, 世界",
    chat("x"),
]


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def assert_clean(engine: Engine) -> None:
    engine.scheduler.check_integrity()
    assert engine.kv_cache.pool.counts()[1] == 0  # no block left in use


# ---- tokenizer -----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_tokenizer_round_trips_any_text(text: str) -> None:
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    assert all(4 <= t < VOCAB_SIZE for t in ids)
    assert TOKENIZER.decode(ids) == text
    assert TOKENIZER.encode(text, add_special_tokens=True) == [BOS_ID, *ids]


def test_tokenizer_specials_chat_template_and_split_characters() -> None:
    ids = chat("hi")
    assert TOKENIZER.decode(ids) == "<|begin|><|header|>user\nhi<|end|><|header|>assistant\n"
    assert TOKENIZER.decode(ids, skip_special_tokens=True) == "user\nhiassistant\n"
    assert TOKENIZER.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        TOKENIZER.decode(ids)
    )
    three_bytes = TOKENIZER.encode("世")
    assert len(three_bytes) == 3
    assert TOKENIZER.decode(three_bytes[:2]) == "\ufffd"  # incomplete: the detokenizer holds it back
    assert TOKENIZER.convert_ids_to_tokens([EOS_ID, three_bytes[0]]) == ["<|end|>", "<0xE4>"]


# ---- determinism and the failover property ------------------------------------------------------


def test_same_prompt_same_tokens_across_engines_and_batches() -> None:
    alone = [build_mock_engine(EngineConfig()).generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    together = build_mock_engine(EngineConfig()).generate(PROMPTS, GREEDY)
    # Chunked prefill (a 7-token budget) and one sequence at a time change every step's batch.
    chunked = build_mock_engine(EngineConfig(max_num_batched_tokens=7, max_num_seqs=1)).generate(
        PROMPTS, GREEDY
    )
    model = MockModel()
    for i, prompt in enumerate(PROMPTS):
        prompt_ids = TOKENIZER.encode(prompt) if isinstance(prompt, str) else prompt
        assert together[i].token_ids == chunked[i].token_ids == alone[i] == model.transcript(prompt_ids, 48)
    assert len({tuple(t) for t in alone}) == len(PROMPTS)  # different prompts, different transcripts


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40), st.integers(0, 30))
def test_resubmitting_prompt_plus_generated_continues_the_transcript(prompt: list[int], k: int) -> None:
    engine = build_mock_engine(EngineConfig(block_size=8))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    (original,) = engine.generate([prompt], params)
    resumed_params = SamplingParams(max_tokens=32 - k, temperature=0.0, ignore_eos=True)
    (resumed,) = engine.generate([prompt + original.token_ids[:k]], resumed_params)
    assert resumed.token_ids == original.token_ids[k:]
    assert_clean(engine)


def test_preemption_with_a_tiny_cache_gives_identical_output() -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [TOKENIZER.encode(f"prompt number {i}") for i in range(6)]
    roomy = build_mock_engine(EngineConfig(block_size=8)).generate(prompts, params)
    tiny = build_mock_engine(EngineConfig(block_size=8), num_kv_blocks=8)  # 64 slots for 6 x ~55
    squeezed = tiny.generate(prompts, params)
    assert tiny.scheduler.num_preemptions > 0
    assert [c.token_ids for c in squeezed] == [c.token_ids for c in roomy]
    assert [c.text for c in squeezed] == [c.text for c in roomy]
    assert_clean(tiny)


# ---- text, stops and lengths through the real engine --------------------------------------------


def test_text_deltas_add_up_to_the_decoded_output_including_split_characters() -> None:
    engine = build_mock_engine(EngineConfig())
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    deltas: dict[str, list[str]] = {i: [] for i in ids}
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for output in engine.step():
            deltas[output.request_id].append(output.text_delta)
            tokens[output.request_id].extend(output.new_token_ids)
            assert "\ufffd" not in output.text_delta
    texts = ["".join(deltas[i]) for i in ids]
    for i, text in zip(ids, texts, strict=True):
        assert text == TOKENIZER.decode(tokens[i], skip_special_tokens=True)
    assert any(not t.isascii() for t in texts)  # multi-byte characters were generated and split
    assert_clean(engine)


def test_stop_strings_max_tokens_and_eos() -> None:
    engine = build_mock_engine(EngineConfig())
    prompt = chat("List the colours of the rainbow.")
    (full,) = engine.generate([prompt], GREEDY)
    assert full.finish_reason is FinishReason.LENGTH and len(full.token_ids) == GREEDY.max_tokens
    stop = full.text[10:13]
    (cut,) = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0, stop=(stop,)))
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(stop)]

    always_eos = build_mock_engine(EngineConfig(), model=MockModel(eos_rate=1.0))
    (ended,) = always_eos.generate([prompt], GREEDY)
    assert ended.finish_reason is FinishReason.STOP and ended.token_ids == [EOS_ID] and ended.text == ""
    (ignored,) = always_eos.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert ignored.finish_reason is FinishReason.LENGTH and ignored.token_ids == [EOS_ID] * 5

    sometimes = build_mock_engine(EngineConfig(), model=MockModel(eos_rate=0.2))
    finished = sometimes.generate(PROMPTS, GREEDY)
    assert all(c.finish_reason is FinishReason.STOP for c in finished)
    assert all(c.token_ids[-1] == EOS_ID and EOS_ID not in c.token_ids[:-1] for c in finished)
    for engine_ in (engine, always_eos, sometimes):
        assert_clean(engine_)


def test_context_limit_ends_with_length() -> None:
    engine = build_mock_engine(EngineConfig(), max_model_len=32)
    prompt = TOKENIZER.encode("x" * 20)
    (done,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert done.finish_reason is FinishReason.LENGTH and len(prompt) + len(done.token_ids) == 32


# ---- the cost model ------------------------------------------------------------------------------


def test_step_duration_follows_the_cost_formula() -> None:
    cost = MockCost(fixed_ms=2.0, per_token_ms=0.05, per_context_token_us=20.0)
    engine = build_mock_engine(EngineConfig(), cost)
    runner = engine.runner
    assert isinstance(runner, MockRunner)
    engine.add_request([7] * 10, GREEDY)
    engine.add_request([8] * 20, GREEDY)

    started = time.monotonic()
    engine.step()  # both prefills: 30 new tokens, contexts 10 + 20
    elapsed = time.monotonic() - started
    expected = 2.0e-3 + 0.05e-3 * 30 + 20e-6 * 30
    assert runner.last_step_seconds == cost.step_seconds(30, 30)
    assert abs(cost.step_seconds(30, 30) - expected) < 1e-12
    assert elapsed >= expected  # the engine thread really was busy that long

    engine.step()  # two decodes: 2 new tokens, contexts 11 + 21
    assert runner.last_step_seconds == cost.step_seconds(2, 32)
    assert runner.num_steps == 2
    assert engine.abort("req-0") and engine.abort("req-1")
    assert_clean(engine)


def test_a_requests_ttft_deadline_counts_from_the_arrival_it_is_given() -> None:
    engine = build_mock_engine(EngineConfig(model="mock"))
    tier = TierRef("interactive", 0, ttft_ms=1000.0)
    arrived = time.monotonic() - 5.0
    late = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), tier=tier, arrival_time=arrived)
    fresh = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), tier=tier)
    assert engine.scheduler.requests[late].ttft_deadline == arrived + 1.0
    deadline = engine.scheduler.requests[fresh].ttft_deadline
    assert deadline is not None and deadline > time.monotonic()
