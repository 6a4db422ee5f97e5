"""Structured outputs in the engine, on the real embedded model: the answer always matches its grammar
(JSON schema, regex, choice, grammar), constrained and plain requests share batches without changing
the plain ones' greedy tokens, and a grammar the engine refuses ends only its own request."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from wire.sampling import SamplingParams
from wire.structured import StructuredOutput
from worker.config import EngineConfig
from worker.engine import Engine
from worker.models.store import pull_default_model
from worker.request import FinishReason
from worker.structured import GrammarError, GrammarQueue, Matcher
from worker.tracing import NULL_OBSERVER, NullObserver

pytestmark = [pytest.mark.slow, pytest.mark.isa]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = Engine.from_config(EngineConfig(model=str(pull_default_model()), dtype="float32"))
    yield engine
    engine.grammars.shutdown()


def chat(engine: Engine, text: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def params(kind: str, spec: str, max_tokens: int = 48) -> SamplingParams:
    structured = StructuredOutput(kind=kind, spec=spec, field=f"structured_outputs.{kind}")  # type: ignore[arg-type]
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=structured)


def test_a_json_schema_answer_parses_and_matches(engine: Engine) -> None:
    prompt = chat(engine, "Describe a person called Ada who is 36, as JSON.")
    (done,) = engine.generate([prompt], params("json", json.dumps(PERSON), max_tokens=64))
    assert done.finish_reason is FinishReason.STOP, done.text
    person = json.loads(done.text)
    assert set(person) == {"name", "age"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 24
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150


def test_regex_choice_and_grammar_answers_match_and_end_there(engine: Engine) -> None:
    prompt = chat(engine, "Is the sky blue? Then give a number.")
    (regex,) = engine.generate([prompt], params("regex", "[0-9]{3}-[A-Z]{2}"))
    assert regex.finish_reason is FinishReason.STOP
    assert len(regex.text) == 6 and regex.text[:3].isdigit() and regex.text[3] == "-"
    (choice,) = engine.generate([prompt], params("choice", json.dumps(["yes", "no", "it depends"])))
    assert choice.text in ("yes", "no", "it depends") and choice.finish_reason is FinishReason.STOP
    lark = 'start: "(" NUMBER ("," NUMBER)* ")"\nNUMBER: /[1-9][0-9]?/'
    (grammar,) = engine.generate([prompt], params("grammar", lark, max_tokens=32))
    assert grammar.text.startswith("(")
    if grammar.finish_reason is FinishReason.STOP:
        assert grammar.text.endswith(")")


def test_plain_requests_beside_constrained_ones_keep_their_greedy_tokens(engine: Engine) -> None:
    plain = [chat(engine, "Name three rivers."), chat(engine, "What is a prime number?")]
    plain_params = SamplingParams(max_tokens=24, temperature=0.0)
    alone = engine.generate(plain, plain_params)
    ids = [engine.add_request(p, plain_params) for p in plain]
    ids += [engine.add_request(plain[0], params("json", json.dumps(PERSON)))]
    ids += [engine.add_request(plain[1], params("choice", '["a", "b"]'))]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    finished: set[str] = set()
    while len(finished) < len(ids):
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.is_finished:
                finished.add(output.request_id)
    assert [tokens[i] for i in ids[:2]] == [c.token_ids for c in alone]


def test_a_grammar_the_engine_refuses_ends_only_its_own_request(engine: Engine) -> None:
    prompt = chat(engine, "Hello")
    bad = engine.add_request(prompt, params("regex", "(a+"))
    good = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.is_finished:
                outputs[output.request_id] = output
    assert outputs[bad].finish_reason is FinishReason.ERROR
    assert outputs[bad].error is not None and "structured_outputs.regex" in outputs[bad].error
    assert outputs[good].finish_reason is FinishReason.LENGTH


def test_aborting_a_request_whose_grammar_compiles_tells_the_observer(engine: Engine) -> None:
    # The tracing observer keeps a live span per request until it hears the request ended.
    aborted: list[str] = []

    class Recording(NullObserver):
        def on_abort(self, request_id: str) -> None:
            aborted.append(request_id)

    engine.observer = Recording()
    try:
        request_id = engine.add_request(chat(engine, "Hi"), params("json", json.dumps(PERSON)))
        assert engine.abort(request_id) and aborted == [request_id]
        assert not engine.has_unfinished() and engine.abort(request_id) is False
    finally:
        engine.observer = NULL_OBSERVER


def test_the_grammar_queue_hands_grammars_back_in_order_failures_as_values(engine: Engine) -> None:
    queue = GrammarQueue(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    try:
        assert not queue and queue.cancel("unknown") is False
        for request_id, kind, spec in [
            ("bad", "regex", "(a+"),
            ("choice", "choice", json.dumps(["yes", "no"])),
            ("dropped", "regex", "[0-9]+"),
        ]:
            structured = params(kind, spec).structured
            assert structured is not None
            queue.submit(request_id, structured)
        assert len(queue) == 3 and queue.cancel("dropped") and len(queue) == 2
        done: list[tuple[str, Matcher | GrammarError]] = []
        deadline = time.monotonic() + 120  # one compile thread: the tokenizer first (about a second)
        while queue and time.monotonic() < deadline:
            done += queue.take_ready()
            time.sleep(0.01)
        assert [request_id for request_id, _ in done] == ["bad", "choice"]
        assert isinstance(done[0][1], GrammarError) and "structured_outputs.regex" in str(done[0][1])
        assert isinstance(done[1][1], Matcher) and not queue.take_ready()
    finally:
        queue.shutdown()
