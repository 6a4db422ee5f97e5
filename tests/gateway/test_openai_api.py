"""Response bodies: TokenDeltas rendered into the OpenAI shapes (gateway/openai_api.py), which the
openai client's types accept; dispatch errors as statuses. The requests: test_openai_requests.py."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk

from gateway.errors import APIError, from_dispatch
from gateway.logprobs import TokenTexts, merge_prompt_logprobs
from gateway.openai_api import (
    ChatRenderer,
    ChoiceResult,
    CompletionRenderer,
    EchoedPrompt,
    PromptScoring,
)
from gateway.openai_requests import ChatCompletionRequest, decode_chat
from gateway.openai_types import UsageInfo
from gateway.request_stream import NoWorkerAvailable, WorkerLost, WorkerRejected
from wire.messages import TokenDelta, TokenLogprob, Usage


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
