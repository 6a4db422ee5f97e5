"""Request decoding and mapping to SamplingParams; response bodies that the openai client's types accept."""

from __future__ import annotations

import msgspec
import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk

from gateway.errors import APIError, from_dispatch, invalid
from gateway.openai_api import ChatRenderer, CompletionRenderer, decode_chat, decode_completion
from gateway.request_stream import NoWorkerAvailable, WorkerLost, WorkerRejected
from wire.errors import InvalidRequestError
from wire.messages import TokenDelta, Usage

MSG = {"role": "user", "content": "hi"}


def chat_body(**fields: object) -> bytes:
    return msgspec.json.encode({"model": "m", "messages": [MSG], **fields})


def test_chat_fields_map_to_sampling_params() -> None:
    request = decode_chat(
        chat_body(
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            seed=3,
            stop="END",
            presence_penalty=0.1,
            frequency_penalty=-0.2,
            user="u",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    sampling = request.to_sampling(room=100)
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed) == (7, 0.5, 0.9, 3)
    assert sampling.stop == ("END",)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.1, -0.2)
    assert request.stream and request.include_usage


def test_max_completion_tokens_wins_and_default_is_the_room_left() -> None:
    assert decode_chat(chat_body(max_tokens=5, max_completion_tokens=9)).to_sampling(room=100).max_tokens == 9
    assert decode_chat(chat_body()).to_sampling(room=100).max_tokens == 100
    assert decode_completion(b'{"model": "m", "prompt": "x"}').to_sampling(room=100).max_tokens == 16


def test_content_parts_are_joined_and_stop_lists_kept() -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    request = decode_chat(msgspec.json.encode({"model": "m", "messages": [parts], "stop": ["x", "y"]}))
    assert request.messages[0].text() == "ab"
    assert request.to_sampling(room=10).stop == ("x", "y")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{", "body"),
        (b'{"messages": []}', "model"),
        (chat_body(temperature="hot"), "temperature"),
        (chat_body(stop=3), "stop"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0]"),
        (b'{"model": "m", "messages": []}', "messages"),
    ],
)
def test_decode_errors_name_the_field(body: bytes, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_chat(body)
    assert info.value.field == field
    error = invalid(info.value)
    assert error.status == 400 and error.param == field


def test_n_and_logprobs_limits() -> None:
    with pytest.raises(InvalidRequestError, match="between 1 and 8"):
        decode_chat(chat_body(n=9)).check_n(8)
    with pytest.raises(InvalidRequestError, match="only n = 1"):
        decode_chat(chat_body(n=2)).check_n(8)
    with pytest.raises(InvalidRequestError, match="logprobs"):
        decode_chat(chat_body(logprobs=True)).to_sampling(room=10)


def test_dispatch_errors_become_statuses() -> None:
    assert from_dispatch(NoWorkerAvailable("m")).status == 503
    assert from_dispatch(WorkerLost("w", "r", "gone")).status == 502
    rejected = from_dispatch(WorkerRejected(400, "max_tokens", "too many"))
    assert (rejected.status, rejected.param) == (400, "max_tokens")
    body = msgspec.json.decode(APIError(413, "too big").response().body)
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"] == "too big"


LAST = TokenDelta(
    request_id="r", epoch=0, finish_reason="length", usage=Usage(prompt_tokens=3, completion_tokens=2)
)


def as_json(payload: object) -> object:
    return msgspec.json.decode(msgspec.json.encode(payload))


def test_chat_bodies_validate_as_openai_types() -> None:
    renderer = ChatRenderer("chatcmpl-1", "m", include_usage=True)
    whole = OpenAIChatCompletion.model_validate(as_json(renderer.whole("hello", LAST)))
    assert whole.choices[0].message.content == "hello" and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.total_tokens == 5
    for chunk in (
        renderer.opening(),
        renderer.chunk("he", None),
        renderer.chunk("", LAST),
        renderer.usage_chunk(LAST),
    ):
        OpenAIChatCompletionChunk.model_validate(as_json(chunk))


def test_completion_bodies_validate_as_openai_types() -> None:
    renderer = CompletionRenderer("cmpl-1", "m", include_usage=False)
    whole = OpenAICompletion.model_validate(as_json(renderer.whole("text", LAST)))
    assert whole.choices[0].text == "text"
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    # The openai type insists on a finish_reason; mid-stream chunks carry null, as OpenAI's own do.
    OpenAICompletion.model_validate(as_json(renderer.chunk("t", LAST)))


def test_gateway_imports_neither_torch_nor_transformers_nor_worker() -> None:
    import subprocess
    import sys

    code = (
        "import sys, gateway.app, gateway.serve, gateway.tokenizer\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'worker')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
