"""The OpenAI request and response bodies this gateway speaks, as msgspec Structs.

Requests decode straight from the body bytes (``decode_chat`` / ``decode_completion``); a wrong type
becomes :class:`~wire.errors.InvalidRequestError` naming the field, as the client wrote it. Unknown
fields are ignored, as OpenAI's own API and other compatible servers do, so newer clients keep working.
Ranges (temperature, top_p, penalties, ...) are checked once, by ``SamplingParams.validate``, on both
sides of the wire.

Only ``n = 1`` is served for now: ``n > 1`` is a 400 saying so (it needs n Submits fanned in). Likewise
logprobs: they map onto ``SamplingParams.logprobs``, but the response side is not written yet, so
asking for them is a 400 rather than a silent null.
"""

from __future__ import annotations

import re
import time
from typing import Literal, Protocol, TypeVar

import msgspec

from wire.errors import InvalidRequestError
from wire.messages import TokenDelta, Usage
from wire.sampling import SamplingParams


class TextPart(msgspec.Struct, kw_only=True):
    type: str = "text"
    text: str = ""


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """Content as one string: parts of type text joined (images and audio are not served)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise InvalidRequestError(
                    "messages", f"content parts of type {part.type!r} are not supported"
                )
        return "".join(part.text for part in self.content)


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_n(self, max_n: int) -> None:
        if not 1 <= self.n <= max_n:
            raise InvalidRequestError("n", f"must be between 1 and {max_n}, got {self.n}")
        if self.n != 1:
            raise InvalidRequestError("n", "only n = 1 is supported by this server for now")

    def sampling(self, *, max_tokens: int | None, logprobs: int | None, room: int) -> SamplingParams:
        """``room``: context left after the prompt, the default when the client sets no limit."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else max(room, 1),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=logprobs,
            stop=stop,
        )


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    def to_sampling(self, room: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs = true")
        num_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        _refuse_logprobs(num_logprobs)
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling(max_tokens=limit, logprobs=num_logprobs, room=room)


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[int]
    logprobs: int | None = None  # the legacy API: a count of top alternatives

    def to_sampling(self, room: int) -> SamplingParams:
        _refuse_logprobs(self.logprobs)
        limit = 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions
        return self.sampling(max_tokens=limit, logprobs=self.logprobs, room=room)


def _refuse_logprobs(num_logprobs: int | None) -> None:
    # The workers compute them; rendering them as OpenAI's token/bytes objects is not done yet, and a
    # silent null would look like a bug to the client.
    if num_logprobs is not None:
        raise InvalidRequestError("logprobs", "logprobs are not supported by this server yet")


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


T = TypeVar("T")


def _decode(body: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH.search(message) or _MISSING.search(message)
        # The path as the client wrote it ("messages[0].content"); the body itself when at the top.
        field = match.group(1) if match and match.group(1) else "body"
        raise InvalidRequestError(field, message) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError("body", f"not valid JSON: {exc}") from None


def decode_chat(body: bytes) -> ChatCompletionRequest:
    request = _decode(body, ChatCompletionRequest)
    if not request.messages:
        raise InvalidRequestError("messages", "must contain at least one message")
    return request


def decode_completion(body: bytes) -> CompletionRequest:
    return _decode(body, CompletionRequest)


# ---------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, usage: Usage) -> UsageInfo:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        )


FinishReason = Literal["stop", "length"]


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str = ""


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Completion(msgspec.Struct, kw_only=True):
    """Both the whole answer and each streamed chunk: OpenAI uses ``text_completion`` for both."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "tierserve"


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- rendering a request's TokenDeltas
# One renderer per request: it knows the id, model and creation time every body repeats.


def finish_reason(delta: TokenDelta | None) -> FinishReason | None:
    """Only "stop" and "length" reach a client; "abort" and "error" become error responses first."""
    if delta is None or delta.finish_reason is None:
        return None
    return "length" if delta.finish_reason == "length" else "stop"


class Renderer(Protocol):
    request_id: str
    include_usage: bool

    def opening(self) -> object | None: ...

    def chunk(self, text: str, last: TokenDelta | None) -> object: ...

    def usage_chunk(self, last: TokenDelta) -> object: ...

    def whole(self, text: str, last: TokenDelta) -> object: ...


class ChatRenderer:
    def __init__(self, request_id: str, model: str, include_usage: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def opening(self) -> object | None:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])

    def chunk(self, text: str, last: TokenDelta | None) -> object:
        delta = ChatDelta(content=text) if text else ChatDelta()
        return self._chunk([ChatChunkChoice(delta=delta, finish_reason=finish_reason(last))])

    def usage_chunk(self, last: TokenDelta) -> object:
        return self._chunk([], UsageInfo.of(last.usage))

    def whole(self, text: str, last: TokenDelta) -> object:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason(last))
        return ChatCompletion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=UsageInfo.of(last.usage),
        )


class CompletionRenderer:
    def __init__(self, request_id: str, model: str, include_usage: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())

    def _body(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> Completion:
        return Completion(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def opening(self) -> object | None:
        return None  # text completions have no role chunk

    def chunk(self, text: str, last: TokenDelta | None) -> object:
        return self._body([CompletionChoice(text=text, finish_reason=finish_reason(last))])

    def usage_chunk(self, last: TokenDelta) -> object:
        return self._body([], UsageInfo.of(last.usage))

    def whole(self, text: str, last: TokenDelta) -> object:
        choice = CompletionChoice(text=text, finish_reason=finish_reason(last))
        return self._body([choice], UsageInfo.of(last.usage))
