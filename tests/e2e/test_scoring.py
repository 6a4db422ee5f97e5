"""Scoring a prompt through a real ``tierserve serve`` on mock workers: the legacy API's ``echo`` (with
``logprobs``; ``max_tokens: 0`` for the prompt alone), a log-likelihood batch as lm-evaluation-harness
sends it, and vLLM's ``prompt_logprobs``. The engine's side: tests/worker/test_prompt_logprobs.py; the
rendering: tests/gateway/test_openai_api.py.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from wire.byte_tokenizer import BYTE_OFFSET

pytestmark = pytest.mark.timeout(120)

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def test_echo_repeats_the_prompt_and_scores_it(client: openai.OpenAI) -> None:
    """The legacy API's echo: the prompt before the answer, its tokens' logprobs before the answer's
    (the first null), and with ``max_tokens`` 0 the prompt alone, scored: what evaluation harnesses send."""
    prompt = "Once upon a time"
    scored = client.completions.create(model="mock", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    logprobs = choice.logprobs
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert "".join(logprobs.tokens) == prompt and len(logprobs.tokens) == scored.usage.prompt_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs is not None
    assert logprobs.top_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(top is not None and 1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(prompt))]

    answer = client.completions.create(model="mock", prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
    both = client.completions.create(
        model="mock", prompt=prompt, max_tokens=5, temperature=0, logprobs=1, echo=True
    )
    both_logprobs = both.choices[0].logprobs
    assert both.choices[0].text == prompt + answer.choices[0].text
    assert both_logprobs is not None and both_logprobs.token_logprobs is not None
    assert both_logprobs.token_logprobs[: len(prompt)] == [None, *(lp for lp in logprobs.token_logprobs[1:])]
    assert answer.choices[0].logprobs is not None
    assert both_logprobs.token_logprobs[len(prompt) :] == answer.choices[0].logprobs.token_logprobs
    tokens = both_logprobs.tokens or []
    assert both_logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(prompt) + 5)]

    chunks = list(
        client.completions.create(
            model="mock", prompt=prompt, max_tokens=5, temperature=0, logprobs=1, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == both.choices[0].text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [lp for part in streamed for lp in part.token_logprobs or []] == both_logprobs.token_logprobs
    ids = [BYTE_OFFSET + b for b in b"Hi"]  # token ids: echoed as their text
    plain = client.completions.create(model="mock", prompt=[ids, ids], max_tokens=2, echo=True)
    assert [c.text[:2] for c in plain.choices] == ["Hi", "Hi"] and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="mock", prompt=prompt, max_tokens=0)
    assert "max_tokens" in str(info.value) and "echo" in str(info.value)


def test_a_loglikelihood_batch_as_lm_evaluation_harness_sends_it(base_url: str) -> None:
    """lm-evaluation-harness's ``local-completions`` scores a context and a continuation: token-id
    prompts in one request, ``echo``, ``max_tokens`` 1, ``logprobs`` 1; it sums
    ``token_logprobs[ctxlen:-1]`` and calls a continuation greedy when each of its tokens' logprob is
    the top one (``top_logprobs[ctxlen:-1]``): so is the mock model's own continuation, not another."""
    from worker.mock import MockModel

    context = [BYTE_OFFSET + b for b in b"Once upon a "]
    greedy: list[int] = []
    for _ in range(4):
        greedy.append(MockModel().next_token_id(context + greedy))
    other = [BYTE_OFFSET + b for b in b"xyzzy"]
    body = {"model": "mock", "prompt": [context + greedy, context + other], "temperature": 0,
            "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    answer = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).json()
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    is_greedy = []
    for choice, continuation in zip(choices, [greedy, other], strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(context) + len(continuation) + 1  # and the new token
        scored = logprobs["token_logprobs"][len(context) : -1]
        tops = logprobs["top_logprobs"][len(context) : -1]
        assert len(scored) == len(continuation) and all(lp <= 0 for lp in scored)
        is_greedy.append(all(lp == max(top.values()) for lp, top in zip(scored, tops, strict=True)))
    assert is_greedy == [True, False]


def test_vllm_prompt_logprobs_on_both_endpoints(client: openai.OpenAI) -> None:
    """vLLM's ``prompt_logprobs``: each prompt token's logprob, rank and alternatives, keyed by token id
    (the first token ``None``), on a completion's choices and on a chat answer."""
    prompt = "Once upon a time"
    echoed = client.completions.create(model="mock", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    completion = client.completions.create(
        model="mock", prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    scored = (completion.choices[0].model_extra or {})["prompt_logprobs"]
    want_ids = [BYTE_OFFSET + b for b in prompt.encode()]
    assert scored[0] is None and len(scored) == len(want_ids)
    assert echoed.choices[0].logprobs is not None
    echo_logprobs = (echoed.choices[0].logprobs.token_logprobs or [])[1:]
    for token_id, entry, logprob in zip(want_ids[1:], scored[1:], echo_logprobs, strict=True):
        mine = entry[str(token_id)]  # the prompt's token, with its rank; then the two most likely
        assert mine["logprob"] == logprob and mine["rank"] >= 1
        assert mine["decoded_token"] == chr(token_id - BYTE_OFFSET)
        ranked = sorted((e["rank"], e["logprob"]) for e in entry.values())
        assert 2 <= len(entry) <= 3 and ranked[0][0] == 1
    chat = client.chat.completions.create(
        model="mock", messages=MSG, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    chat_scored = (chat.model_extra or {})["prompt_logprobs"]
    assert chat.usage is not None and len(chat_scored) == chat.usage.prompt_tokens
    assert chat_scored[0] is None and all(len(entry) == 1 for entry in chat_scored[1:])
    assert "prompt_logprobs" not in (
        client.chat.completions.create(model="mock", messages=MSG, max_tokens=2).model_extra or {}
    )
