"""vLLM's fields on what an answer may hold and what it carries, through a real ``tierserve serve`` on
mock workers: ``allowed_token_ids`` and ``bad_words`` (tokens it may not sample), ``return_token_ids``
(the prompt's and the answer's ids, what RL trainers read back), ``return_tokens_as_token_ids``
(logprobs naming tokens by id) and ``include_stop_str_in_output``. The mock model's greedy answer is
known from the prompt's ids (``MODEL.transcript``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.mock_helpers import MODEL, TOKENIZER, chat_ids, expected_text

pytestmark = pytest.mark.timeout(120)


def _post(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{base_url}{path}", json={"model": "mock", "temperature": 0, **body}, timeout=30)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _events(base_url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    body = {"model": "mock", "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=30) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_return_token_ids_on_a_chat(base_url: str) -> None:
    """The answer's ``prompt_token_ids`` are the templated prompt's; each choice's ``token_ids`` its
    tokens (the EOS that ended it included, as vLLM's are). Streamed: the prompt's on the role chunk,
    each chunk's own ids after it. Not asked for: neither field is there."""
    messages = [{"role": "user", "content": "Tell me a story"}]
    prompt = chat_ids("Tell me a story")
    answer = _post(
        base_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "return_token_ids": True}
    )
    assert answer["prompt_token_ids"] == prompt
    choice = answer["choices"][0]
    assert choice["token_ids"] == MODEL.transcript(prompt, 12)
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"]
    assert TOKENIZER.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]

    events = _events(
        base_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "return_token_ids": True}
    )
    assert events[0]["prompt_token_ids"] == prompt and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in e for e in events[1:])
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == choice["token_ids"]

    plain = _post(base_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    plain_events = _events(base_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    assert not any(
        "prompt_token_ids" in e or any("token_ids" in c for c in e["choices"]) for e in plain_events
    )


def test_return_token_ids_on_completions(base_url: str) -> None:
    """Every choice of every prompt carries its prompt's ids and its own (``n`` choices a prompt);
    streamed, a choice's first chunk carries its prompt's."""
    prompts = ["Once upon", "In a galaxy"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 6, "seed": 1, "return_token_ids": True}
    answer = _post(base_url, "/v1/completions", {**body, "temperature": 0})
    for choice in answer["choices"]:
        prompt = TOKENIZER.encode(prompts[choice["index"] // 2])
        assert choice["prompt_token_ids"] == prompt
        assert choice["token_ids"] == MODEL.transcript(prompt, 6)
        assert choice["text"] == expected_text(prompt, 6)

    events = _events(base_url, "/v1/completions", body)
    firsts: dict[int, dict[str, Any]] = {}
    ids: dict[int, list[int]] = {}
    for event in events:
        for choice in event["choices"]:
            if choice["index"] not in firsts:
                firsts[choice["index"]] = choice
            elif "prompt_token_ids" in choice:
                raise AssertionError(f"a later chunk of choice {choice['index']} repeats its prompt's ids")
            ids.setdefault(choice["index"], []).extend(choice.get("token_ids", []))
    assert sorted(firsts) == [0, 1, 2, 3]
    for index, first in firsts.items():
        assert first["prompt_token_ids"] == TOKENIZER.encode(prompts[index // 2])
    assert ids == {c["index"]: c["token_ids"] for c in answer["choices"]}


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="mock",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in MODEL.transcript(chat_ids("hi"), 5)]
    assert all(top.token.startswith("token_id:") for c in content for top in c.top_logprobs)
    assert content[0].bytes == list(content[0].token.encode())

    legacy = client.completions.create(
        model="mock",
        prompt="hi",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    logprobs = legacy.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens == [f"token_id:{t}" for t in MODEL.transcript(TOKENIZER.encode("hi"), 5)]
    assert all(key.startswith("token_id:") for top in logprobs.top_logprobs for key in top or {})
    assert legacy.choices[0].text == expected_text(TOKENIZER.encode("hi"), 5)  # the text stays text


def test_include_stop_str_in_output_keeps_the_stop_string(client: openai.OpenAI) -> None:
    """The text ends after the stop string that ended it, whole and streamed; without the field,
    before it."""
    prompt = "The weather today"
    full = expected_text(TOKENIZER.encode(prompt), 40)
    stop = full[10:13]
    assert stop and stop in full, full
    before = full[: full.index(stop)]
    kept = client.completions.create(
        model="mock",
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == before + stop and kept.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="mock",
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"include_stop_str_in_output": True},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == before + stop
    dropped = client.completions.create(
        model="mock", prompt=prompt, max_tokens=40, temperature=0, stop=[stop]
    )
    assert dropped.choices[0].text == before


def test_allowed_token_ids_and_bad_words_hold_the_answer(client: openai.OpenAI) -> None:
    """Only allowed tokens are sampled (greedy or not); a bad word never appears in the answer, while
    it would without the field; out-of-vocabulary ids and empty words are a 400 naming the field."""
    allowed = [TOKENIZER.encode(ch)[0] for ch in "ab "]
    for temperature in (0.0, 1.0):
        answer = client.completions.create(
            model="mock",
            prompt="hello",
            max_tokens=12,
            temperature=temperature,
            seed=3,
            extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
        )
        assert set(answer.choices[0].text) <= set("ab ") and len(answer.choices[0].text) == 12

    prompt = "The weather today"
    full = expected_text(TOKENIZER.encode(prompt), 40)
    word = full[6:9]
    assert word.strip() == word and word, full
    barred = client.completions.create(
        model="mock", prompt=prompt, max_tokens=40, temperature=0, extra_body={"bad_words": [word]}
    )
    assert word in full and word not in barred.choices[0].text
    assert (
        barred.choices[0].text[: full.index(word) + len(word) - 1] == full[: full.index(word) + len(word) - 1]
    )

    for body, param in (
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words[0]"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="mock", prompt=prompt, max_tokens=4, extra_body=body)
        assert info.value.body["param"] == param  # type: ignore[index]


def test_stop_reason_names_what_ended_each_choice(base_url: str) -> None:
    """vLLM's ``stop_reason``: the stop string (or stop token id) that ended a choice, null for a
    length; on every choice of a whole answer, on a stream's finishing chunk only."""
    prompt = "The weather today"
    ids = TOKENIZER.encode(prompt)
    full = expected_text(ids, 40)
    stop = full[10:13]
    whole = _post(base_url, "/v1/completions", {"prompt": prompt, "max_tokens": 40, "stop": [stop]})
    assert whole["choices"][0]["finish_reason"] == "stop" and whole["choices"][0]["stop_reason"] == stop
    cut = _post(base_url, "/v1/completions", {"prompt": prompt, "max_tokens": 3})
    assert cut["choices"][0]["finish_reason"] == "length" and cut["choices"][0]["stop_reason"] is None
    token = MODEL.transcript(ids, 40)[5]
    by_id = _post(
        base_url, "/v1/completions", {"prompt": prompt, "max_tokens": 40, "stop_token_ids": [token]}
    )
    assert by_id["choices"][0]["stop_reason"] == token

    messages = [{"role": "user", "content": "Tell me a story"}]
    answer = expected_text(chat_ids("Tell me a story"), 40)
    chat_stop = answer[4:6]
    chat = _post(
        base_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 40, "stop": [chat_stop]}
    )
    assert chat["choices"][0]["stop_reason"] == chat_stop
    for path, body, expected in (
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 40, "stop": [chat_stop]}, chat_stop),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 40, "stop": [stop]}, stop),
    ):
        choices = [c for e in _events(base_url, path, body) for c in e["choices"]]
        assert [c["stop_reason"] for c in choices if "stop_reason" in c] == [expected]
        assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == expected


def test_the_answer_id_may_be_the_clients(base_url: str) -> None:
    """A proxy's ``X-Request-Id`` (else vLLM's ``request_id`` field) names the answer as vLLM names it,
    in its body and its own ``X-Request-Id``; two requests may share one (the gateway's own ids keep
    them apart); an id that is no header value is a 400 naming where it came from."""
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "mock", "messages": messages, "max_tokens": 3, "temperature": 0}
    with httpx.Client(base_url=base_url, timeout=30) as http:
        answers = [
            http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "edge-7f3a"})
            for _ in range(2)
        ]
        for answer in answers:
            assert answer.status_code == 200 and answer.json()["id"] == "chatcmpl-edge-7f3a"
            assert answer.headers["x-request-id"] == "chatcmpl-edge-7f3a"
        named = http.post(
            "/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 2, "request_id": "job-1"}
        )
        assert named.json()["id"] == "cmpl-job-1"
        both = http.post(
            "/v1/completions",
            json={"model": "mock", "prompt": "hi", "max_tokens": 2, "request_id": "job-1"},
            headers={"X-Request-Id": "from-proxy"},
        )
        assert both.json()["id"] == "cmpl-from-proxy"  # the header wins, as in vLLM
        streamed = _events(
            base_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "request_id": "s-1"}
        )
        assert {e["id"] for e in streamed} == {"chatcmpl-s-1"}
        response = http.post(
            "/v1/responses",
            json={"model": "mock", "input": "hi", "max_output_tokens": 3},
            headers={"X-Request-Id": "r9"},
        )
        assert response.status_code == 200 and response.json()["id"] == "resp_r9", response.text
        own = http.post("/v1/chat/completions", json=body)
        assert own.json()["id"].startswith("chatcmpl-") and own.headers["x-request-id"] == own.json()["id"]
        for fields, headers, param in (
            ({"request_id": "has space"}, {}, "request_id"),
            ({"request_id": "x" * 129}, {}, "request_id"),
            ({}, {"X-Request-Id": "two words"}, "X-Request-Id"),
        ):
            bad = http.post("/v1/chat/completions", json={**body, **fields}, headers=headers)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
