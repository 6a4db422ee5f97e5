"""``tierserve serve`` as a real process, driven by the official openai client and raw httpx: the API
surface, on mock workers (fast; the ``mock_server`` fixture, tests/e2e/conftest.py). When things go
wrong (clients leaving, garbage on the socket, a worker killed) is test_serve_resilience.py; the real
embedded model (slow) is in test_serve_smollm2.py, a GGUF pool in test_serve_gguf.py. Scoring a prompt
(echo, prompt_logprobs) is test_scoring.py; vLLM's prompt-shaping and answer fields,
test_prompt_shaping.py and test_vllm_answer_fields.py.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.mock_helpers import TOKENIZER, chat_ids, expected_text
from wire.byte_tokenizer import BYTE_OFFSET

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def test_health_ready_models(base_url: str, client: openai.OpenAI) -> None:
    assert httpx.get(f"{base_url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{base_url}/ready", timeout=5).status_code == 200
    assert [m.id for m in client.models.list()] == ["mock"]
    assert client.models.retrieve("mock").id == "mock"
    version = httpx.get(f"{base_url}/version", timeout=5).json()  # vLLM's route
    assert version == {"version": importlib.metadata.version("tierserve")}
    tokenized = httpx.post(f"{base_url}/tokenize", json={"model": "mock", "prompt": "a"}, timeout=5).json()
    card = httpx.get(f"{base_url}/v1/models/mock", timeout=5).json()
    assert card["max_model_len"] == tokenized["max_model_len"] > 0  # vLLM's field: the longest context
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_chat_non_stream(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="mock", messages=[{"role": "user", "content": "Hello there"}], max_tokens=20, temperature=0
    )
    assert raw.headers["x-sla-tier"] == "standard"
    assert raw.headers["x-tierserve-model"] == "mock"
    assert raw.headers["x-context-class"] == "short"
    completion = raw.parse()
    assert raw.headers["x-request-id"] == completion.id  # the id logs and traces name it by
    ids = chat_ids("Hello there")
    assert completion.choices[0].message.content == expected_text(ids, 20)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(ids), 20)
    assert completion.usage.total_tokens == len(ids) + 20


def test_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="mock",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "東京 ✓"}],
        max_completion_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = TOKENIZER.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "東京 ✓"}]
    )
    assert isinstance(ids, list)
    assert text == expected_text(ids, 30)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 30)


def test_completions_non_stream_and_stream(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    ids = TOKENIZER.encode(prompt)
    whole = client.completions.create(model="mock", prompt=prompt, max_tokens=25, temperature=0)
    assert whole.choices[0].text == expected_text(ids, 25)
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 25)
    chunks = list(
        client.completions.create(
            model="mock",
            prompt=prompt,
            max_tokens=25,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text(ids, 25)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 25


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(base_url: str, path: str) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (with include_usage): each chunk carries the
    usage so far, its completion tokens counting up to the final usage chunk's."""
    prompt = {"messages": MSG} if path == CHAT else {"prompt": "Once upon a time"}
    body = {"model": "mock", **prompt, "max_tokens": 12, "temperature": 0, "stream": True}
    chunks = _streamed(
        f"{base_url}{path}",
        {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    token_chunks = [c for c in chunks if c["choices"] and _chunk_text(c["choices"][0])]
    assert token_chunks and all(c["usage"] is not None for c in token_chunks)
    counts = [c["usage"]["completion_tokens"] for c in token_chunks]
    assert counts == sorted(counts) and counts[0] >= 1
    final = chunks[-1]
    assert not final["choices"] and final["usage"]["completion_tokens"] == 12 >= counts[-1]
    assert {c["usage"]["prompt_tokens"] for c in token_chunks} == {final["usage"]["prompt_tokens"]}
    # Without include_usage it asks for nothing (as in vLLM): no usage anywhere.
    chunks = _streamed(f"{base_url}{path}", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert chunks and all(c["usage"] is None for c in chunks)


def _streamed(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed answer, as JSON objects (the closing ``[DONE]`` left out)."""
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200
        data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"]


def _chunk_text(choice: dict[str, Any]) -> str:
    return str(choice.get("text") or choice.get("delta", {}).get("content") or "")


def test_tokenize_and_detokenize_as_vllm_shapes_them(base_url: str) -> None:
    prompt = "Once upon a time"
    got = httpx.post(f"{base_url}/tokenize", json={"model": "mock", "prompt": prompt}, timeout=10).json()
    ids = TOKENIZER.encode(prompt)
    assert got == {
        "count": len(ids),
        "max_model_len": got["max_model_len"],
        "tokens": ids,
        "token_strs": None,
    }
    assert got["max_model_len"] > len(ids)
    chat = httpx.post(
        f"{base_url}/tokenize",
        json={"model": "mock", "messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True},
        timeout=10,
    ).json()
    assert chat["tokens"] == chat_ids("Hi") and len(chat["token_strs"]) == chat["count"]
    back = httpx.post(f"{base_url}/detokenize", json={"model": "mock", "tokens": ids}, timeout=10).json()
    assert back == {"prompt": prompt}
    for path, body, param in [
        ("/tokenize", {"model": "mock"}, "prompt"),
        ("/tokenize", {"model": "mock", "prompt": "a", "messages": []}, "prompt"),
        ("/tokenize", {"model": "mock", "prompt": "a", "add_bos": True}, "add_bos"),
        (
            "/tokenize",
            {"model": "mock", "messages": [{"role": "wizard", "content": "a"}]},
            "messages[0].role",
        ),
        ("/detokenize", {"model": "mock", "tokens": [1, 10**6]}, "tokens"),
    ]:
        response = httpx.post(f"{base_url}{path}", json=body, timeout=10)
        assert response.status_code == 400, (path, body, response.text)
        assert response.json()["error"]["param"] == param
    unknown = httpx.post(f"{base_url}/detokenize", json={"model": "gpt-17", "tokens": [1]}, timeout=10)
    assert unknown.status_code == 404


def test_a_developer_message_is_a_system_message(client: openai.OpenAI) -> None:
    """OpenAI's newer role name: rendered as ``system`` by the chat template, as clients expect."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = TOKENIZER.apply_chat_template(messages)
    assert isinstance(ids, list)
    completion = client.chat.completions.create(
        model="mock",
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
    )
    assert completion.choices[0].message.content == expected_text(ids, 8)


def test_logit_bias_reaches_the_sampler(client: openai.OpenAI) -> None:
    """+100 on one byte's token makes every greedy token that byte; -100 on the mock's own next
    token makes the first one something else."""
    forced = TOKENIZER.encode("Z")[0]
    text = client.completions.create(
        model="mock", prompt="Once", max_tokens=6, temperature=0, logit_bias={str(forced): 100}
    )
    assert text.choices[0].text == "Z" * 6
    ids = TOKENIZER.encode("Once")
    first = TOKENIZER.encode(expected_text(ids, 1))[0]
    banned = client.completions.create(
        model="mock", prompt="Once", max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != expected_text(ids, 1)


def test_stop_string_ends_the_text(client: openai.OpenAI) -> None:
    ids = chat_ids("stop test")
    full = expected_text(ids, 40)
    stop = full[10:12]
    completion = client.chat.completions.create(
        model="mock",
        messages=[{"role": "user", "content": "stop test"}],
        max_tokens=40,
        temperature=0,
        stop=stop,
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == full[: full.index(stop)]


def test_sixteen_concurrent_streams(base_url: str) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        prompt = f"request number {i}"
        stream = await client.chat.completions.create(
            model="mock",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=32,
            temperature=0,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return text, expected_text(chat_ids(prompt), 32)

    async def main() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key="unused", timeout=60, max_retries=0
        ) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(16))), timeout=90)

    results = asyncio.run(main())
    assert len(results) == 16
    for got, expected in results:
        assert got == expected


def test_n_choices_streamed_and_whole(client: openai.OpenAI) -> None:
    ids = chat_ids("three of them")
    expected = expected_text(ids, 12)
    whole = client.chat.completions.create(
        model="mock",
        messages=[{"role": "user", "content": "three of them"}],
        max_tokens=12,
        temperature=0,
        n=3,
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == [expected] * 3
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 36)  # the prompt once
    chunks = list(
        client.chat.completions.create(
            model="mock",
            messages=[{"role": "user", "content": "three of them"}],
            max_tokens=12,
            temperature=0,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = ["", "", ""]
    finished = []
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.append(choice.index)
    assert texts == [expected] * 3 and sorted(finished) == [0, 1, 2]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 36


def test_completions_with_a_list_of_prompts(client: openai.OpenAI) -> None:
    prompts = ["first prompt", "second, longer prompt"]
    whole = client.completions.create(model="mock", prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]  # prompt-major: (p0, p0, p1, p1)
    expected = [expected_text(TOKENIZER.encode(p), 8) for p in prompts]
    assert [c.text for c in whole.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == sum(len(TOKENIZER.encode(p)) for p in prompts)
    assert whole.usage.completion_tokens == 32
    long = client.completions.with_raw_response.create(model="mock", prompt="x" * 1500, max_tokens=1)
    assert long.headers["x-context-class"] == "medium"  # 1500 byte tokens: past the 1024 of "short"
    token_ids = [TOKENIZER.encode(p) for p in prompts]
    by_ids = client.completions.create(model="mock", prompt=token_ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == expected


def test_logprobs_chat_and_legacy(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="mock",
        messages=[{"role": "user", "content": "logprobs"}],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = chat.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == 10
    assert bytes(b for entry in content for b in entry.bytes or []).decode() == choice.message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the chosen is the best
    legacy = client.completions.create(
        model="mock", prompt="logprobs", max_tokens=6, temperature=0, logprobs=2
    )
    logprobs = legacy.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.text_offset is not None
    assert "".join(logprobs.tokens) == legacy.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert logprobs.top_logprobs is not None and all(len(top) <= 2 for top in logprobs.top_logprobs)
    plain = client.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "no logprobs"}], max_tokens=3
    )
    assert plain.choices[0].logprobs is None


def test_min_tokens_holds_back_a_stop_token_id(client: openai.OpenAI) -> None:
    """vLLM's ``min_tokens``: the mock model's first greedy token named as a stop token ends the answer
    at once, unless ``min_tokens`` says two tokens must come first (the first then another)."""
    from worker.mock import MockModel

    prompt = "Once upon a time"
    first = MockModel().transcript(TOKENIZER.encode(prompt), 1)[0]
    stopped = client.completions.create(
        model="mock", prompt=prompt, max_tokens=5, temperature=0, extra_body={"stop_token_ids": [first]}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage is not None
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].text == ""
    held = client.completions.create(
        model="mock",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=0,
        extra_body={"stop_token_ids": [first], "min_tokens": 2},
    )
    assert held.usage is not None and held.usage.completion_tokens >= 2
    assert held.choices[0].text[:1] != chr(first - BYTE_OFFSET)  # the banned token did not come first


def test_an_unknown_field_is_a_400_naming_it_and_no_op_fields_pass(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="mock", messages=MSG, max_tokens=3, extra_body={"some_future_field": {"x": 1}}
        )
    assert "some_future_field" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="mock", prompt="Once", max_tokens=3, suffix="upon")
    assert "suffix" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="mock", messages=MSG, max_tokens=3, modalities=["text", "audio"])
    assert "modalities" in str(info.value)
    completion = client.chat.completions.create(
        model="mock",
        messages=MSG,
        max_tokens=3,
        user="u-1",
        metadata={"run": "7"},
        store=False,
        prompt_cache_key="agent-7",
        safety_identifier="4f1c",
        modalities=["text"],
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 3


def test_null_fields_are_their_defaults(base_url: str) -> None:
    """A client that writes every optional field (``"n": null``, ``"stream": null``) is served as one
    that leaves them out: a whole (not streamed) answer of one choice."""
    nulls = dict.fromkeys(
        ["n", "stream", "logprobs", "presence_penalty", "frequency_penalty", "stop", "seed"]
    )
    body = {"model": "mock", "messages": MSG, "max_tokens": 3, "temperature": 0, **nulls}
    response = httpx.post(f"{base_url}{CHAT}", json=body, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert len(response.json()["choices"]) == 1 and response.json()["usage"]["completion_tokens"] == 3


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="mock", messages=MSG, temperature=-2)
    assert "temperature" in str(info.value)


def test_wrong_method_and_path_are_json_errors(base_url: str) -> None:
    for response in (
        httpx.get(f"{base_url}{CHAT}", timeout=5),
        httpx.get(f"{base_url}/v2/nothing", timeout=5),
    ):
        assert response.status_code in (404, 405)
        assert response.json()["error"]["message"]


def test_structured_outputs_hold_on_the_mock_model_too(client: openai.OpenAI) -> None:
    """The mock's byte vocabulary serves the grammar engine as well: its answer is masked to the
    choice or regex, whatever the mock model would have said."""
    choice = client.chat.completions.create(
        model="mock",
        messages=[{"role": "user", "content": "pick"}],
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
        temperature=0,
    )
    assert choice.choices[0].message.content in ("alpha", "beta")
    assert choice.choices[0].finish_reason == "stop"
    regex = client.completions.create(
        model="mock", prompt="Once", max_tokens=20, extra_body={"structured_outputs": {"regex": "[0-9]{5}"}}
    )
    assert regex.choices[0].text.isdigit() and len(regex.choices[0].text) == 5
