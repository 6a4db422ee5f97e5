"""Engine behaviour on the real embedded model: bad input, abort, stops, seeds, caching, CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wire.errors import InvalidRequestError
from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import Engine
from worker.models.store import pull_default_model
from worker.request import FinishReason

pytestmark = [pytest.mark.slow, pytest.mark.isa]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_config(
        EngineConfig(model=str(pull_default_model()), kv_cache_gb=0.25, max_model_len=512)
    )


def chat(engine: Engine, text: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], GREEDY, "prompt"),
        ("", GREEDY, "prompt"),
        ([1, 2, 10**9], GREEDY, "prompt"),
        ([5] * 600, GREEDY, "prompt"),
        ([5] * 500, SamplingParams(max_tokens=20), "max_tokens"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
        ([5, 6], SamplingParams(top_p=1.5), "top_p"),
        ([5, 6], SamplingParams(temperature=-0.1), "temperature"),
        ([5, 6], SamplingParams(stop_token_ids=(10**6,)), "stop_token_ids"),
    ],
)
def test_bad_input_is_a_typed_error_and_the_engine_keeps_serving(
    engine: Engine, prompt: list[int] | str, params: SamplingParams, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(prompt, params)
    assert info.value.field == field
    assert not engine.has_unfinished()
    [done] = engine.generate([chat(engine, "Say hi.")], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(done.token_ids) >= 1


def test_deltas_add_up_to_the_decoded_text(engine: Engine) -> None:
    prompts = [chat(engine, "What is the capital of France?"), chat(engine, "Count from 1 to 5.")]
    for done in engine.generate(prompts, GREEDY):
        shown = [t for t in done.token_ids if t not in engine.eos_token_ids]
        assert done.text == engine.tokenizer.decode(shown, skip_special_tokens=True)
    assert "Paris" in engine.generate(prompts[:1], GREEDY)[0].text


def test_eos_stops_and_max_tokens_cuts(engine: Engine) -> None:
    (short,) = engine.generate([chat(engine, "What is the capital of France?")], GREEDY)
    assert short.finish_reason is FinishReason.STOP and short.token_ids[-1] in engine.eos_token_ids
    (cut,) = engine.generate(
        [chat(engine, "Write a long story.")], SamplingParams(max_tokens=5, temperature=0)
    )
    assert cut.finish_reason is FinishReason.LENGTH and len(cut.token_ids) == 5


def test_stop_string_truncates_and_never_leaks(engine: Engine) -> None:
    prompt = chat(engine, "List the colours of the rainbow.")
    (full,) = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))
    stop = full.text[10:14]
    assert len(stop) == 4
    (cut,) = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,)))
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(stop)]


def test_seeded_sampling_is_reproducible_in_any_batch(engine: Engine) -> None:
    prompt = chat(engine, "Invent a name for a cat.")
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    (alone,) = engine.generate([prompt], seeded)
    engine.add_request(chat(engine, "Tell me a joke."), SamplingParams(max_tokens=16, temperature=1.0))
    again = engine.generate([prompt], seeded)[0]
    while engine.has_unfinished():
        engine.step()
    assert again.token_ids == alone.token_ids


def test_abort_frees_blocks_and_spares_the_others(engine: Engine) -> None:
    keep = engine.add_request(chat(engine, "Name three fruits."), GREEDY)
    drop = engine.add_request(
        chat(engine, "Name three rivers."), SamplingParams(max_tokens=200, temperature=0)
    )
    engine.step()
    engine.step()
    assert engine.abort(drop)
    assert not engine.abort(drop)
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id != drop
            if output.is_finished:
                finished[output.request_id] = output
    assert keep in finished
    engine.scheduler.check_integrity()
    assert engine.kv_cache.pool.counts()[1] == 0  # no block left in use


def test_repeated_prompt_reports_cached_tokens_and_logprobs(engine: Engine) -> None:
    prompt = chat(engine, "Explain prefix caching in one sentence. " * 8)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
    (first,) = engine.generate([prompt], params)
    (second,) = engine.generate([prompt], params)
    assert second.num_cached_tokens >= len(prompt) - 16 > 0
    assert second.token_ids == first.token_ids
    assert all(
        len(lp.top) == 3 and lp.top[0][0] == tok
        for lp, tok in zip(second.logprobs, second.token_ids, strict=True)
    )


def test_a_resumed_request_counts_the_resumed_tokens_as_output(engine: Engine) -> None:
    """A failover's continuation (the client has the first 5 tokens): the engine goes on to the token
    where the first run went, and its usage is the client's, those 5 tokens output, not prompt (also
    when the request ends early)."""
    prompt = chat(engine, "Name three primary colours.")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (first,) = engine.generate([prompt], params)
    seen = first.token_ids[:5]
    rest = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(prompt + seen, rest, seen_token_ids=first.token_ids[1:6])
    assert info.value.field == "resumed_token_ids"

    resumed = engine.add_request(prompt + seen, rest, request_id="resumed", seen_token_ids=seen)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == resumed]
    assert [t for o in outputs for t in o.new_token_ids] == first.token_ids[5:]
    last = outputs[-1]
    assert (last.num_prompt_tokens, last.num_output_tokens) == (len(prompt), 12)
    assert 0 < last.num_cached_tokens <= len(prompt)  # its own blocks cached, counted up to the prompt

    ended = engine.add_request(prompt + seen, rest, request_id="ended", seen_token_ids=seen)
    engine.step()
    out = engine.end(ended, FinishReason.ABORT)
    assert (out.num_prompt_tokens, out.num_output_tokens) == (len(prompt), 5 + 1)
    engine.scheduler.check_integrity()


def test_cli_generate_answers() -> None:
    pull_default_model()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.cli",
            "generate",
            "--max-tokens",
            "20",
            "What is the capital of France?",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "Paris" in out.stdout


def test_a_failed_step_fails_its_requests_only_and_the_engine_serves_on(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = engine.add_request(chat(engine, "This step will break."), GREEDY)
    real_execute = engine.runner.execute

    def broken(out):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(engine.runner, "execute", real_execute)  # only this one step fails
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.runner, "execute", broken)
    [failed] = engine.step()
    assert failed.request_id == victim and failed.finish_reason is FinishReason.ERROR and failed.error
    assert not engine.has_unfinished()
    engine.scheduler.check_integrity()
    assert engine.kv_cache.pool.counts()[1] == 0
    [done] = engine.generate([chat(engine, "What is the capital of France?")], GREEDY)
    assert "Paris" in done.text
