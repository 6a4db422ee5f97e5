"""vLLM's fields that shape the prompt before it runs, through a real ``tierserve serve`` on mock
workers: ``continue_final_message`` and ``add_generation_prompt`` (a prefilled answer),
``add_special_tokens``, ``chat_template_kwargs`` and ``truncate_prompt_tokens``; and ``cache_salt``, which
cached blocks a prompt may read. The mock model's answer
is a pure function of the prompt's ids, so each test knows the ids the server ran from the answer and
the usage alone. Template rendering against transformers: tests/gateway/test_tokenizer.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.mock_helpers import TOKENIZER, chat_ids, expected_text
from wire.byte_tokenizer import BOS_ID

pytestmark = pytest.mark.timeout(120)

PREFILLED: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour is"},
]


def _template_ids(messages: list[ChatCompletionMessageParam], **options: bool) -> list[int]:
    ids = TOKENIZER.apply_chat_template([dict(m) for m in messages], **options)  # type: ignore[misc]
    assert isinstance(ids, list)
    return ids


def test_continue_final_message_goes_on_with_the_assistants_text(client: openai.OpenAI) -> None:
    """A prefilled answer: the last message left open, no new turn; the answer is what comes after it."""
    answer = client.chat.completions.create(
        model="mock",
        messages=PREFILLED,
        max_tokens=8,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    ids = _template_ids(PREFILLED, continue_final_message=True)
    assert ids[-1] != TOKENIZER.eos_token_id  # the assistant's turn is not closed
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == expected_text(ids, 8)

    closed = client.chat.completions.create(
        model="mock",
        messages=PREFILLED,
        max_tokens=8,
        temperature=0,
        extra_body={"add_generation_prompt": False},
    )
    ids = _template_ids(PREFILLED, add_generation_prompt=False)
    assert closed.usage is not None and closed.usage.prompt_tokens == len(ids)
    assert closed.choices[0].message.content == expected_text(ids, 8)

    with pytest.raises(openai.BadRequestError) as info:  # with the default add_generation_prompt: true
        client.chat.completions.create(
            model="mock", messages=PREFILLED, max_tokens=8, extra_body={"continue_final_message": True}
        )
    assert info.value.body["param"] == "continue_final_message"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="mock",
            messages=[*PREFILLED[:1], {"role": "assistant", "content": "  "}],
            max_tokens=8,
            extra_body={"add_generation_prompt": False, "continue_final_message": True},
        )
    assert info.value.body["param"] == "messages[1].content"  # type: ignore[index]


def test_add_special_tokens_and_template_kwargs_on_a_chat(client: openai.OpenAI) -> None:
    """``add_special_tokens``: the tokenizer's BOS on top of the template's. ``chat_template_kwargs``
    reach the template (the mock's reads none: the prompt is the same); they may set the two flags, as
    vLLM lets them, not the messages or tools."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    plain = chat_ids("hi")
    with_bos = client.chat.completions.create(
        model="mock", messages=messages, max_tokens=4, temperature=0, extra_body={"add_special_tokens": True}
    )
    assert with_bos.usage is not None and with_bos.usage.prompt_tokens == len(plain) + 1
    assert with_bos.choices[0].message.content == expected_text([BOS_ID, *plain], 4)
    kwargs = client.chat.completions.create(
        model="mock",
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert kwargs.choices[0].message.content == expected_text(plain, 4)
    # the two flags may come in the kwargs too, as vLLM takes them (agent frameworks send them there)
    prefilled = client.chat.completions.create(
        model="mock",
        messages=PREFILLED,
        max_tokens=4,
        temperature=0,
        extra_body={"chat_template_kwargs": {"add_generation_prompt": False, "continue_final_message": True}},
    )
    assert prefilled.choices[0].message.content == expected_text(
        _template_ids(PREFILLED, continue_final_message=True), 4
    )
    for kwargs, param in (
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"tools": []}, "chat_template_kwargs.tools"),
        ({"add_generation_prompt": 1}, "chat_template_kwargs.add_generation_prompt"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="mock", messages=messages, max_tokens=4, extra_body={"chat_template_kwargs": kwargs}
            )
        assert info.value.body["param"] == param  # type: ignore[index]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client: openai.OpenAI) -> None:
    """Left truncation on both endpoints: the answer and the usage are the kept tokens'; an echo repeats
    what ran; -1 keeps what the context takes (all of a short prompt)."""
    prompt = "0123456789"
    ids = TOKENIZER.encode(prompt)
    cut = client.completions.create(
        model="mock", prompt=prompt, max_tokens=6, temperature=0, extra_body={"truncate_prompt_tokens": 4}
    )
    assert cut.usage is not None and cut.usage.prompt_tokens == 4
    assert cut.choices[0].text == expected_text(ids[-4:], 6)
    echoed = client.completions.create(
        model="mock",
        prompt=[prompt, "ab"],
        max_tokens=6,
        temperature=0,
        echo=True,
        extra_body={"truncate_prompt_tokens": 4},
    )
    short = "ab" + expected_text(TOKENIZER.encode("ab"), 6)  # shorter than 4 tokens: all of it
    assert [c.text for c in echoed.choices] == ["6789" + cut.choices[0].text, short]
    whole = client.completions.create(
        model="mock", prompt=prompt, max_tokens=6, temperature=0, extra_body={"truncate_prompt_tokens": -1}
    )
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)

    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "a longer question"}]
    chat = client.chat.completions.create(
        model="mock", messages=messages, max_tokens=4, temperature=0, extra_body={"truncate_prompt_tokens": 5}
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
    assert chat.choices[0].message.content == expected_text(chat_ids("a longer question")[-5:], 4)
    for value in (0, -2):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model="mock", prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": value}
            )
        assert info.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def test_add_special_tokens_on_a_text_prompt(client: openai.OpenAI) -> None:
    """A text prompt is encoded as its tokenizer encodes text by default (the mock's adds nothing);
    ``add_special_tokens: true`` puts its BOS first."""
    ids = TOKENIZER.encode("hello")
    default = client.completions.create(model="mock", prompt="hello", max_tokens=4, temperature=0)
    assert default.choices[0].text == expected_text(ids, 4)
    bos = client.completions.create(
        model="mock", prompt="hello", max_tokens=4, temperature=0, extra_body={"add_special_tokens": True}
    )
    assert bos.usage is not None and bos.usage.prompt_tokens == len(ids) + 1
    assert bos.choices[0].text == expected_text([BOS_ID, *ids], 4)


def test_tokenize_takes_the_same_prompt_fields(base_url: str) -> None:
    """``/tokenize`` counts a chat as the chat endpoint would run it, with the same fields."""

    def tokenize(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{base_url}/tokenize", json={"model": "mock", **body}, timeout=10)

    body = {"messages": PREFILLED, "add_generation_prompt": False, "continue_final_message": True}
    assert tokenize(body).json()["tokens"] == _template_ids(PREFILLED, continue_final_message=True)
    assert (
        tokenize({**body, "add_special_tokens": True}).json()["count"]
        == len(_template_ids(PREFILLED, continue_final_message=True)) + 1
    )
    assert tokenize({"prompt": "hi", "add_special_tokens": True}).json()["tokens"][0] == BOS_ID
    for bad, param in (
        ({**body, "add_generation_prompt": True}, "continue_final_message"),
        ({"prompt": "hi", "chat_template_kwargs": {}}, "chat_template_kwargs"),
        ({"prompt": "hi", "continue_final_message": True}, "continue_final_message"),
        ({"messages": PREFILLED, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ):
        response = tokenize(bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, bad


def test_echo_on_a_chat_repeats_the_message_the_answer_continues(client: openai.OpenAI) -> None:
    """vLLM's chat ``echo``: a continued message comes back whole, its text before the model's (a
    stream's first content chunk); after a new turn's prompt, a user's last message is not repeated."""
    continued = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    answer = client.chat.completions.create(
        model="mock", messages=PREFILLED, max_tokens=8, temperature=0, extra_body=continued
    )
    rest = expected_text(_template_ids(PREFILLED, continue_final_message=True), 8)
    assert answer.choices[0].message.content == "The colour is" + rest
    chunks = list(
        client.chat.completions.create(
            model="mock", messages=PREFILLED, max_tokens=8, temperature=0, stream=True, extra_body=continued
        )
    )
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert contents[0] == "The colour is" and "".join(contents) == "The colour is" + rest
    fresh = client.chat.completions.create(
        model="mock", messages=PREFILLED[:1], max_tokens=8, temperature=0, extra_body={"echo": True}
    )
    assert fresh.choices[0].message.content == expected_text(chat_ids("Name a colour."), 8)


def test_cache_salt_keeps_cached_blocks_to_requests_sending_it(base_url: str) -> None:
    """vLLM's ``cache_salt``: a prompt's cached blocks serve later requests with the same salt on the
    worker that cached them, and no request with another salt or none (``cached_tokens`` in the usage
    says which; ``x-tierserve-worker`` where it ran). Four requests on two workers: a worker runs the
    salted prompt twice at least once."""
    prompt = "A salted prompt, long enough to fill several blocks of the KV cache. " * 3

    def run(salt: str | None) -> tuple[str, int]:
        body = {"model": "mock", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        answer = httpx.post(f"{base_url}/v1/completions", json={**body, "cache_salt": salt}, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.headers["x-tierserve-worker"], answer.json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]

    seen: set[str] = set()
    repeats = 0
    for _ in range(4):
        worker, cached = run("team-a")
        assert (cached > 0) == (worker in seen), (worker, cached, seen)
        repeats += worker in seen
        seen.add(worker)
    assert repeats >= 2
    assert run("team-b")[1] == 0 and run(None)[1] == 0
