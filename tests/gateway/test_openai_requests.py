"""Request decoding: the chat and completion bodies as Structs, their fields mapped to SamplingParams,
and every mistake a 400 naming its field (gateway/openai_requests.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.errors import invalid
from gateway.openai_requests import ChatCompletionRequest, CompletionRequest, decode_chat, decode_completion
from wire.errors import InvalidRequestError

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


def test_vllm_extension_fields_map_to_sampling_params_and_bad_ones_name_themselves() -> None:
    """ignore_eos, top_k, min_p, repetition_penalty, stop_token_ids, skip_special_tokens: what vLLM
    accepts beside the OpenAI fields (benchmark clients send ignore_eos)."""
    body = {"ignore_eos": True, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
            "stop_token_ids": [7, 9], "skip_special_tokens": False}  # fmt: skip
    for request in (
        decode_chat(chat_body(**body)),
        decode_completion(msgspec.json.encode({"model": "m", "prompt": "x", **body})),
    ):
        sampling = request.to_sampling(room=100)
        assert (sampling.ignore_eos, sampling.top_k, sampling.min_p, sampling.repetition_penalty) == (
            True,
            40,
            0.05,
            1.1,
        )
        assert sampling.stop_token_ids == (7, 9) and not sampling.skip_special_tokens
    assert all(decode_chat(chat_body(top_k=k)).to_sampling(room=10).top_k is None for k in (0, -1))
    bad = decode_chat(chat_body(min_p=2.0)).to_sampling(room=10)
    with pytest.raises(InvalidRequestError) as caught:
        bad.validate(vocab_size=100, max_model_len=20, num_prompt_tokens=5)
    assert caught.value.field == "min_p"
    with pytest.raises(InvalidRequestError) as caught:
        decode_chat(chat_body(stop_token_ids=[1000])).to_sampling(room=10).validate(
            vocab_size=100, max_model_len=20, num_prompt_tokens=5
        )
    assert caught.value.field == "stop_token_ids"


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


@pytest.mark.parametrize(
    ("decode", "body", "field"),
    [
        (decode_chat, chat_body(some_future_field={"x": 1}), "some_future_field"),
        (decode_completion, b'{"model": "m", "prompt": "x", "service_tier": "flex"}', "service_tier"),
        (decode_chat, chat_body(store=True), "store"),
        (decode_chat, chat_body(modalities=["text", "audio"]), "modalities"),
        (decode_chat, chat_body(modalities=[]), "modalities"),
        (decode_completion, b'{"model": "m", "prompt": "x", "prompt_cache_key": "k"}', "prompt_cache_key"),
        (
            decode_chat,
            chat_body(structured_outputs={"regex": "a+", "disable_any_whitespace": True}),
            "structured_outputs.disable_any_whitespace",
        ),
        (
            decode_chat,
            chat_body(response_format={"type": "json_object", "schema": {}}),
            "response_format.schema",
        ),
        (decode_completion, b'{"model": "m", "prompt": "x", "suffix": "end"}', "suffix"),
        (decode_completion, b'{"model": "m", "prompt": "x", "n": 2, "best_of": 3}', "best_of"),
        (decode_completion, b'{"model": "m", "prompt": "x", "frobnicate": true}', "frobnicate"),
    ],
)
def test_a_field_that_would_be_dropped_is_a_400_naming_it(decode: Any, body: bytes, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode(body)
    error = invalid(info.value)
    assert error.status == 400 and error.param == field


@pytest.mark.parametrize("decode", [decode_chat, decode_completion])
def test_a_top_level_null_is_the_field_s_default(decode: Any) -> None:
    """OpenAI's API takes null for an optional field as its default; clients that write every field
    (``"n": null``, ``"stream": null``) must get the same request as those that leave them out."""
    if decode is decode_chat:
        base: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        fields = ChatCompletionRequest.__struct_fields__
    else:
        base = {"model": "m", "prompt": "x"}
        fields = CompletionRequest.__struct_fields__
    optional = [f for f in fields if f not in base]
    with_nulls = decode(msgspec.json.encode({**base, **dict.fromkeys(optional), "service_tier": None}))
    assert with_nulls == decode(msgspec.json.encode(base))
    # Below the top level a null is kept: in a JSON schema it means something.
    schema = {"type": "object", "properties": {"a": {"const": None}}}
    if decode is decode_chat:
        response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        request = decode(msgspec.json.encode({**base, "n": None, "response_format": response_format}))
        assert request.response_format.json_schema.schema == schema
    with pytest.raises(InvalidRequestError) as info:  # a required field is still required
        decode(msgspec.json.encode({**base, "model": None}))
    assert info.value.field == "model"


def test_fields_that_change_nothing_are_accepted() -> None:
    """OpenAI's no-op fields at their no-op values, and keys inside messages and options that clients
    replaying OpenAI's own responses send (``refusal``, ``annotations``)."""
    message: dict[str, object] = {"role": "assistant", "content": "hi", "refusal": None, "annotations": []}
    chat = decode_chat(
        chat_body(
            messages=[{"role": "user", "content": "x"}, message, {"role": "user", "content": "y"}],
            user="u-1",
            metadata={"run": "7"},
            store=False,
            prompt_cache_key="agent-7",
            safety_identifier="4f1c",
            modalities=["text"],
            stream_options={"include_usage": True, "include_obfuscation": False},
        )
    )
    assert chat.include_usage and [m.role for m in chat.messages] == ["user", "assistant", "user"]
    legacy = decode_completion(
        b'{"model": "m", "prompt": "x", "echo": false, "suffix": "", "n": 2, "best_of": 2}'
    )
    assert legacy.n == 2


def test_n_and_logprobs_map_to_sampling() -> None:
    with pytest.raises(InvalidRequestError, match="between 1 and 8"):
        decode_chat(chat_body(n=9)).check_n(8)
    decode_chat(chat_body(n=8)).check_n(8)
    assert decode_chat(chat_body(logprobs=True)).to_sampling(room=10).logprobs == 0
    assert decode_chat(chat_body(logprobs=True, top_logprobs=3)).to_sampling(room=10).logprobs == 3
    assert decode_chat(chat_body()).to_sampling(room=10).logprobs is None
    with pytest.raises(InvalidRequestError, match="needs logprobs"):
        decode_chat(chat_body(top_logprobs=3)).to_sampling(room=10)
    legacy = decode_completion(b'{"model": "m", "prompt": "x", "logprobs": 2}')
    assert legacy.to_sampling(room=10).logprobs == 2


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("one", ["one"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_completion_prompt_forms(prompt: object, expected: list[object]) -> None:
    request = decode_completion(msgspec.json.encode({"model": "m", "prompt": prompt}))
    assert request.prompts(max_prompts=4) == expected


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([], "must not be empty"),
        (["a", 1], "all strings"),
        ([[1], "a"], "all strings"),
        (["a"] * 5, "at most 4"),
    ],
)
def test_completion_prompt_mistakes(prompt: object, match: str) -> None:
    request = decode_completion(msgspec.json.encode({"model": "m", "prompt": prompt}))
    with pytest.raises(InvalidRequestError, match=match) as info:
        request.prompts(max_prompts=4)
    assert info.value.field == "prompt"


def test_vllm_prompt_fields_shape_the_chat_options() -> None:
    """How the messages become the prompt: the fields, or the same flags in ``chat_template_kwargs``
    (as vLLM takes them); what the server sets itself, and a continued turn that opens a new one, are
    400s naming the field."""
    prefilled = [MSG, {"role": "assistant", "content": "The answer is"}]
    body = decode_chat(
        chat_body(messages=prefilled, add_generation_prompt=False, continue_final_message=True)
    )
    options = body.chat_options()
    assert (options.add_generation_prompt, options.continue_final_message) == (False, True)
    assert (
        body.echoed() == ""
        and decode_chat(chat_body(messages=prefilled, echo=True)).echoed() == "The answer is"
    )
    assert decode_chat(chat_body(echo=True)).echoed() == ""  # a new turn after a user: nothing repeated
    kwargs = {"add_generation_prompt": False, "continue_final_message": True, "enable_thinking": False}
    via_kwargs = decode_chat(chat_body(messages=prefilled, chat_template_kwargs=kwargs)).chat_options()
    assert (via_kwargs.add_generation_prompt, via_kwargs.continue_final_message) == (False, True)
    assert via_kwargs.template_kwargs == {"enable_thinking": False}
    for fields, field in (
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        (
            {"chat_template_kwargs": {"add_generation_prompt": "no"}},
            "chat_template_kwargs.add_generation_prompt",
        ),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            decode_chat(chat_body(messages=prefilled, **fields))
        assert info.value.field == field


def test_vllm_answer_fields_map_to_sampling_params() -> None:
    body = decode_completion(
        msgspec.json.encode(
            {
                "model": "m",
                "prompt": "hi",
                "allowed_token_ids": [3, 5],
                "bad_words": ["no"],
                "include_stop_str_in_output": True,
                "truncate_prompt_tokens": -1,
            }
        )
    )
    sampling = body.to_sampling(room=100)
    assert sampling.allowed_token_ids == (3, 5) and sampling.include_stop_str_in_output
    assert sampling.bad_words == ()  # tokenized for the placed model by the gateway, not here
    assert body.truncation() == -1 and body.add_special_tokens is None
