"""Request decoding and mapping to SamplingParams; response bodies that the openai client's types accept."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk

from gateway.errors import APIError, from_dispatch, invalid
from gateway.logprobs import TokenTexts, merge_prompt_logprobs
from gateway.openai_api import (
    ChatRenderer,
    ChoiceResult,
    CompletionRenderer,
    EchoedPrompt,
    PromptScoring,
)
from gateway.openai_requests import ChatCompletionRequest, CompletionRequest, decode_chat, decode_completion
from gateway.openai_types import UsageInfo
from gateway.request_stream import NoWorkerAvailable, WorkerLost, WorkerRejected
from wire.errors import InvalidRequestError
from wire.messages import TokenDelta, TokenLogprob, Usage

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


def test_usage_counts_a_shared_prompt_once() -> None:
    usages = [
        Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=4),
        Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4),
        Usage(prompt_tokens=7, completion_tokens=1),
    ]
    total = UsageInfo.total(usages, [0, 0, 1])
    assert (total.prompt_tokens, total.completion_tokens, total.total_tokens) == (17, 9, 26)
    assert total.prompt_tokens_details.cached_tokens == 4


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


USAGE = UsageInfo.total([LAST.usage], [0])
TEXTS = TokenTexts({1: b"he", 2: b"llo", 3: b"\xe2\x9c", 4: b"\x93"}.__getitem__)
LOGPROBS = [
    TokenLogprob(token_id=1, logprob=-0.1, top=[(1, -0.1), (2, -2.5)]),
    TokenLogprob(token_id=2, logprob=-0.2, top=[(2, -0.2)]),
]


def test_chat_bodies_validate_as_openai_types() -> None:
    renderer = ChatRenderer("chatcmpl-1", "m", include_usage=True)
    results = [ChoiceResult(0, "hello", [], "length"), ChoiceResult(1, "bye", [], "stop")]
    whole = OpenAIChatCompletion.model_validate(as_json(renderer.whole(results, USAGE)))
    assert [c.message.content for c in whole.choices] == ["hello", "bye"]
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].logprobs is None
    assert whole.usage is not None and whole.usage.total_tokens == 5
    middle = TokenDelta(request_id="r", epoch=0, text="he", usage=LAST.usage)
    chunks = [
        *renderer.opening(1),
        *renderer.chunks(1, middle),
        *renderer.chunks(1, LAST),
        *renderer.closing(USAGE),
    ]
    parsed = [OpenAIChatCompletionChunk.model_validate(as_json(chunk)) for chunk in chunks]
    assert [c.choices[0].index for c in parsed[:3]] == [1, 1, 1]
    assert parsed[1].choices[0].delta.content == "he" and parsed[2].choices[0].finish_reason == "length"
    assert parsed[3].choices == [] and parsed[3].usage is not None
    assert renderer.chunks(0, TokenDelta(request_id="r", epoch=0, usage=LAST.usage)) == []


def test_chat_logprobs_carry_token_text_and_exact_bytes() -> None:
    renderer = ChatRenderer("chatcmpl-1", "m", include_usage=False, texts=TEXTS)
    whole = OpenAIChatCompletion.model_validate(
        as_json(renderer.whole([ChoiceResult(0, "hello", LOGPROBS, "stop")], USAGE))
    )
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    expected = [("he", -0.1, [104, 101]), ("llo", -0.2, [108, 108, 111])]
    assert [(t.token, t.logprob, t.bytes) for t in logprobs.content] == expected
    assert [(t.token, t.logprob) for t in logprobs.content[0].top_logprobs] == [("he", -0.1), ("llo", -2.5)]
    # A token that is half a character: its bytes are exact, its text has a replacement character.
    half = ChatRenderer("c", "m", False, TEXTS).whole(
        [ChoiceResult(0, "✓", [TokenLogprob(token_id=3, logprob=-1.0)], "stop")], USAGE
    )
    entry = as_json(half)["choices"][0]["logprobs"]["content"][0]  # type: ignore[index]
    assert entry["bytes"] == [0xE2, 0x9C] and entry["token"] == "\ufffd"
    # Streamed: a delta with logprobs but no text yet (held back) still sends them.
    held = TokenDelta(request_id="r", epoch=0, logprobs=LOGPROBS[:1], usage=LAST.usage)
    [chunk] = renderer.chunks(0, held)
    assert as_json(chunk)["choices"][0]["logprobs"]["content"][0]["token"] == "he"  # type: ignore[index]


def test_completion_bodies_validate_as_openai_types() -> None:
    renderer = CompletionRenderer("cmpl-1", "m", include_usage=False)
    whole = OpenAICompletion.model_validate(
        as_json(renderer.whole([ChoiceResult(0, "text", [], "length")], USAGE))
    )
    assert whole.choices[0].text == "text"
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    # The openai type insists on a finish_reason; mid-stream chunks carry null, as OpenAI's own do.
    [chunk] = renderer.chunks(0, LAST)
    OpenAICompletion.model_validate(as_json(chunk))


def test_completion_logprobs_in_the_legacy_shape_with_offsets_across_chunks() -> None:
    renderer = CompletionRenderer("cmpl-1", "m", include_usage=False, texts=TEXTS)
    first = TokenDelta(request_id="r", epoch=0, text="he", logprobs=LOGPROBS[:1], usage=LAST.usage)
    second = TokenDelta(request_id="r", epoch=0, text="llo", logprobs=LOGPROBS[1:], usage=LAST.usage)
    bodies = [as_json(c) for d in (first, second) for c in renderer.chunks(0, d)]
    logprobs = [b["choices"][0]["logprobs"] for b in bodies]  # type: ignore[index]
    top = [{"he": -0.1, "llo": -2.5}]
    assert logprobs[0] == {
        "tokens": ["he"],
        "token_logprobs": [-0.1],
        "top_logprobs": top,
        "text_offset": [0],
    }
    assert logprobs[1]["text_offset"] == [2]


def test_echo_puts_the_scored_prompt_before_the_answer_streamed_and_whole() -> None:
    """The prompt "he llo he" (ids 1 2 1), scored a chunk at a time, one position sent twice (a request
    moved to another worker is scored again); the answer "llo" after it. The first prompt token has no
    logprob, as OpenAI's legacy API answers."""
    echo = [EchoedPrompt("hellohe", 1)]
    scored = [TokenLogprob(token_id=2, logprob=-0.5), TokenLogprob(token_id=1, logprob=-1.5)]
    answer = TokenLogprob(token_id=2, logprob=-0.25)
    deltas = [
        TokenDelta(request_id="r", epoch=0, prompt_logprobs=scored[:1], prompt_position=1, usage=LAST.usage),
        TokenDelta(request_id="r", epoch=1, prompt_logprobs=scored, prompt_position=1, usage=LAST.usage),
        TokenDelta(request_id="r", epoch=1, token_ids=[2], text="llo", logprobs=[answer], usage=LAST.usage),
        TokenDelta(request_id="r", epoch=1, finish_reason="length", usage=LAST.usage),
    ]
    want = {
        "tokens": ["he", "llo", "he", "llo"],
        "token_logprobs": [None, -0.5, -1.5, -0.25],
        "top_logprobs": [None, {}, {}, {}],
        "text_offset": [0, 2, 5, 7],
    }
    streamed = CompletionRenderer("cmpl-1", "m", include_usage=False, texts=TEXTS, echo=echo)
    bodies = [as_json(c) for d in deltas for c in streamed.chunks(0, d)]
    assert len(bodies) == 2  # the prompt's logprobs wait for the echo, which goes with the first token
    first = bodies[0]["choices"][0]  # type: ignore[index]
    assert first["text"] == "hellohello" and first["logprobs"] == want
    assert bodies[1]["choices"][0]["text"] == "" and bodies[1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    # (not checked against the openai package's types: they say float where OpenAI's own API, vLLM and
    # this server send null for the first token; the client builds its objects without validating)

    whole = CompletionRenderer("cmpl-1", "m", include_usage=False, texts=TEXTS, echo=echo, n=2)
    result = [ChoiceResult(i, "llo", [answer], "length", prompt_logprobs=scored) for i in range(2)]
    body = as_json(whole.whole(result, USAGE))
    assert [c["text"] for c in body["choices"]] == ["hellohello"] * 2  # type: ignore[index]
    assert [c["logprobs"] for c in body["choices"]] == [want, want]  # type: ignore[index]
    # echo without logprobs: the text alone; max_tokens 0: the prompt alone
    plain = CompletionRenderer("cmpl-1", "m", include_usage=False, echo=echo)
    assert as_json(plain.whole([ChoiceResult(0, "", [], "length")], USAGE))["choices"][0] == {  # type: ignore[index]
        "index": 0,
        "text": "hellohe",
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,  # vLLM's: no stop string or stop token ended it
    }


def test_vllm_prompt_logprobs_key_each_token_by_id_with_its_rank() -> None:
    """vLLM's shape: None for the first token, then the prompt's token (its own rank) and the most
    likely ones (ranks 1 ..), each keyed by its id as a string; the token once where it is among them."""
    scored = [
        TokenLogprob(token_id=2, logprob=-0.5, top=[(1, -0.25), (2, -0.5)], rank=2),
        TokenLogprob(token_id=1, logprob=-3.0, top=[(2, -0.1), (4, -2.0)], rank=9),
    ]
    scoring = PromptScoring(TEXTS, num_top=1)
    chat = as_json(
        ChatRenderer("c", "m", False, scoring=scoring).whole(
            [ChoiceResult(0, "x", [], "stop", scored)], USAGE
        )
    )
    assert chat["prompt_logprobs"] == [  # type: ignore[index]
        None,
        {
            "2": {"logprob": -0.5, "rank": 2, "decoded_token": "llo"},
            "1": {"logprob": -0.25, "rank": 1, "decoded_token": "he"},
        },
        {
            "1": {"logprob": -3.0, "rank": 9, "decoded_token": "he"},
            "2": {"logprob": -0.1, "rank": 1, "decoded_token": "llo"},
        },
    ]
    assert "prompt_logprobs" not in as_json(
        ChatRenderer("c", "m", False).whole([ChoiceResult(0, "x", [], "stop")], USAGE)
    )  # type: ignore[operator]
    # with echo too: the echo keeps the answer's own count of alternatives (logprobs: 0), vLLM's its own
    renderer = CompletionRenderer(
        "c", "m", False, TEXTS, [EchoedPrompt("hellohe", 1)], scoring=PromptScoring(TEXTS, 2)
    )
    [choice] = as_json(renderer.whole([ChoiceResult(0, "", [], "length", scored)], USAGE))["choices"]  # type: ignore[index]
    assert choice["logprobs"]["top_logprobs"] == [None, {}, {}]
    assert [len(entry) for entry in choice["prompt_logprobs"][1:]] == [2, 3]


def test_prompt_logprobs_merge_by_position() -> None:
    have: list[TokenLogprob] = []
    entries = [TokenLogprob(token_id=t, logprob=-float(t)) for t in range(1, 6)]
    merge_prompt_logprobs(have, 1, entries[:2])
    merge_prompt_logprobs(have, 1, entries[:3])  # scored again from the start: only position 3 is new
    merge_prompt_logprobs(have, 4, entries[3:])
    assert have == entries
    with pytest.raises(ValueError):
        merge_prompt_logprobs(have, 8, entries[:1])  # a gap: a chunk went missing


def test_gateway_imports_neither_torch_nor_transformers_nor_worker() -> None:
    import subprocess
    import sys

    code = (
        "import sys, gateway.app, gateway.serve, gateway.tokenizer\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'worker')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def ping_tool_body() -> ChatCompletionRequest:
    """A chat request offering one tool, ``ping``."""
    return decode_chat(
        msgspec.json.encode(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "ping"}}],
            }
        )
    )


def test_tool_calls_render_as_openai_types_whole_and_streamed() -> None:
    body = ping_tool_body()
    renderer = ChatRenderer("chatcmpl-1", "m", include_usage=False, tools=body.tool_spec())
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    whole = OpenAIChatCompletion.model_validate(
        as_json(renderer.whole([ChoiceResult(0, "On it.\n" + call, [], "stop")], USAGE))
    )
    message = whole.choices[0].message
    assert message.content == "On it." and whole.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls is not None and message.tool_calls[0].function.name == "ping"
    pieces = ["On it.\n<tool", call[5:30], call[30:]]
    deltas = [TokenDelta(request_id="r", epoch=0, text=p, usage=LAST.usage) for p in pieces]
    deltas.append(TokenDelta(request_id="r", epoch=0, finish_reason="stop", usage=LAST.usage))
    chunks = [c for d in deltas for c in renderer.chunks(0, d)]
    parsed = [OpenAIChatCompletionChunk.model_validate(as_json(chunk)) for chunk in chunks]
    content = "".join(c.choices[0].delta.content or "" for c in parsed)
    calls = [t for c in parsed for t in c.choices[0].delta.tool_calls or []]
    assert content == "On it.\n" and [(t.index, t.function and t.function.name) for t in calls] == [
        (0, "ping")
    ]
    assert parsed[-1].choices[0].finish_reason == "tool_calls"
    # Without tools the same text is content, and "stop" stays "stop".
    plain = ChatRenderer("chatcmpl-2", "m", include_usage=False)
    (choice,) = OpenAIChatCompletion.model_validate(
        as_json(plain.whole([ChoiceResult(0, call, [], "stop")], USAGE))
    ).choices
    assert (
        choice.message.content == call
        and choice.finish_reason == "stop"
        and choice.message.tool_calls is None
    )


def test_a_llama_style_answer_streams_as_tool_calls_when_its_template_taught_that_format() -> None:
    body = ping_tool_body()
    spec = body.tool_spec()
    assert spec is not None
    tools = dataclasses.replace(spec, answer_format="llama3_json")
    renderer = ChatRenderer("chatcmpl-3", "m", include_usage=False, tools=tools)
    pieces = ['{"name": "pi', 'ng", "parameters": {"n"', ": 1}}"]
    deltas = [TokenDelta(request_id="r", epoch=0, text=p, usage=LAST.usage) for p in pieces]
    deltas.append(TokenDelta(request_id="r", epoch=0, finish_reason="stop", usage=LAST.usage))
    chunks = [c for d in deltas for c in renderer.chunks(0, d)]
    parsed = [OpenAIChatCompletionChunk.model_validate(as_json(chunk)) for chunk in chunks]
    assert "".join(c.choices[0].delta.content or "" for c in parsed) == ""
    calls = [t for c in parsed for t in c.choices[0].delta.tool_calls or []]
    assert [
        (t.index, t.function and t.function.name, t.function and t.function.arguments) for t in calls
    ] == [(0, "ping", '{"n": 1}')]
    assert parsed[-1].choices[0].finish_reason == "tool_calls"
