"""The rendering of a request's TokenDeltas into the OpenAI response bodies (gateway/openai_types.py;
the requests: openai_requests.py).

A request becomes one or more *choices* (``n`` of them per prompt; ``/v1/completions`` also takes a
list of prompts), each a Submit of its own; a :class:`Renderer` turns their TokenDeltas back into one
OpenAI response, each choice under its ``index``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec
from msgspec import UNSET, UnsetType

from gateway.logprobs import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprobs,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    merge_prompt_logprobs,
    vllm_prompt_logprobs,
)
from gateway.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    FinishReason,
    FunctionCall,
    StopReason,
    TokenIds,
    ToolCall,
    ToolCallDelta,
    UsageInfo,
)
from gateway.tool_calls import AnswerParser, ParsedCall, answer_parser, parse_whole
from gateway.tools import ToolSpec
from wire.messages import TokenDelta, TokenLogprob

if TYPE_CHECKING:
    from gateway.errors import ErrorBody

# ---------------------------------------------------------------- rendering a request's TokenDeltas
# One renderer per request: it knows the id, model and creation time every body repeats, and whether
# logprobs were asked for (then every choice carries a logprobs object, else null).


def finish_reason(delta: TokenDelta | None) -> FinishReason | None:
    """Only "stop" and "length" reach a client; "abort" and "error" become error responses first."""
    if delta is None or delta.finish_reason is None:
        return None
    return "length" if delta.finish_reason == "length" else "stop"


@dataclass(slots=True)
class ChoiceResult:
    """One finished choice, for a non-streamed body."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # a scored prompt's, positions 1 on
    token_ids: list[int] = field(default_factory=list)
    stop_reason: StopReason = None  # vLLM's: the stop string or stop token id that ended it


@dataclass(frozen=True, slots=True)
class EchoedPrompt:
    """A prompt as the legacy API's ``echo`` repeats it before the answer: the client's text (token ids
    decoded), and its first token (the one a scored prompt has no logprob for)."""

    text: str
    first_token_id: int


@dataclass(frozen=True, slots=True)
class PromptScoring:
    """vLLM's ``prompt_logprobs``: the answer carries its prompt's tokens' logprobs and ranks, with
    ``num_top`` alternatives each (never streamed)."""

    texts: TokenTexts
    num_top: int

    def render(self, entries: Sequence[TokenLogprob]) -> PromptLogprobs:
        return vllm_prompt_logprobs(self.texts, entries, self.num_top)


@dataclass(frozen=True, slots=True)
class Rendering:
    """What a request's renderer needs beside its body, known once the request is placed."""

    request_id: str
    model: str
    texts: TokenTexts | None  # given when logprobs were asked for
    tools: ToolSpec | None  # the request's, whose calls are parsed out of the text (gateway/tools.py)
    service_tier: str | None  # what the answer says the request ran at
    echo: list[EchoedPrompt] | None = None  # per prompt: the legacy API's echo
    scoring: PromptScoring | None = None  # vLLM's prompt_logprobs
    prompt_ids: list[list[int]] | None = None  # per prompt, where vLLM's return_token_ids asks for them


class Renderer(Protocol):
    """A stream is ``opening`` of each choice, ``chunks`` as tokens come, ``closing`` once every choice
    has finished (or ``failure`` instead, where the request failed midway), each payload framed by
    ``frame``, then ``done``; a whole answer is ``whole``."""

    request_id: str

    def opening(self, index: int) -> list[object]:
        """What a stream sends for choice ``index`` before its first token (chat: the role)."""
        ...

    def chunks(self, index: int, delta: TokenDelta, usage: UsageInfo | None = None) -> list[object]:
        """What a stream sends for one TokenDelta of choice ``index`` (nothing for an empty one);
        ``usage``, where given, on each of them (vLLM's ``continuous_usage_stats``)."""
        ...

    def closing(self, usage: UsageInfo) -> list[object]:
        """What a stream sends after every choice's last token (chat: the usage chunk, if asked for)."""
        ...

    def failure(self, error: ErrorBody, status: int) -> list[object]:
        """What a stream sends in place of the rest when the request fails midway."""
        ...

    def frame(self, payload: object) -> bytes:
        """One payload as a server-sent event."""
        ...

    @property
    def done(self) -> bytes:
        """What a stream ends with, after the last event (chat: ``data: [DONE]``)."""
        ...

    def whole(self, choices: Sequence[ChoiceResult], usage: UsageInfo) -> object: ...


DONE = b"data: [DONE]\n\n"


class DataEvents:
    """The Chat Completions and legacy Completions APIs' streams: unnamed ``data:`` events, the usage
    chunk last when asked for, an error as its error body, then ``[DONE]``."""

    include_usage: bool

    def usage_chunk(self, usage: UsageInfo) -> object:
        raise NotImplementedError

    def closing(self, usage: UsageInfo) -> list[object]:
        return [self.usage_chunk(usage)] if self.include_usage else []

    def failure(self, error: ErrorBody, status: int) -> list[object]:
        return [error]

    def frame(self, payload: object) -> bytes:
        return b"data: " + msgspec.json.encode(payload) + b"\n\n"

    @property
    def done(self) -> bytes:
        return DONE


class ChatRenderer(DataEvents):
    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        texts: TokenTexts | None = None,
        tools: ToolSpec | None = None,
        service_tier: str | None = None,
        scoring: PromptScoring | None = None,
        prompt_ids: Sequence[int] | None = None,
        echo: str = "",
    ) -> None:
        """``texts``: given when logprobs were asked for; ``tools``: the request's, whose calls are
        parsed out of each choice's text (gateway/tools.py) unless tool_choice is ``none``;
        ``service_tier``: what every chunk and the whole answer say the request ran at; ``scoring``:
        vLLM's ``prompt_logprobs``, on the whole answer (every choice scores the same prompt);
        ``prompt_ids``: given for vLLM's ``return_token_ids``, with every choice's token ids;
        ``echo``: vLLM's, the text each choice's content begins with (a stream's first content chunk:
        the last message, which the answer continues)."""
        self.echo = echo
        self.scoring = scoring
        self.prompt_ids = None if prompt_ids is None else list(prompt_ids)
        self.request_id = request_id
        self.model = model
        self.service_tier = service_tier
        self.include_usage = include_usage
        self.texts = texts
        self.tools = tools if tools is not None and tools.in_prompt else None
        self.created = int(time.time())
        self._parsers: dict[int, AnswerParser] = {}  # choice index → its stream's parser

    def _chunk(
        self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None, prompt_ids: TokenIds = UNSET
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            service_tier=self.service_tier,
            prompt_token_ids=prompt_ids,
        )

    def _ids(self, token_ids: Sequence[int]) -> TokenIds:
        return UNSET if self.prompt_ids is None else list(token_ids)

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> ChatLogprobs | None:
        if self.texts is None:
            return None
        return ChatLogprobs(content=chat_logprobs(self.texts, entries or ()))

    def opening(self, index: int) -> list[object]:
        role = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
        out: list[object] = [
            self._chunk([role], prompt_ids=UNSET if self.prompt_ids is None else self.prompt_ids)
        ]
        if self.echo:
            out.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=self.echo))]))
        return out

    def chunks(self, index: int, delta: TokenDelta, usage: UsageInfo | None = None) -> list[object]:
        out: list[object] = []
        text, parser, num_before = delta.text, None, 0
        calls: list[ParsedCall] = []
        if self.tools is not None:
            parser = self._parsers.get(index)
            if parser is None:
                parser = self._parsers[index] = answer_parser(self.tools)
            num_before = len(parser.calls)
            text, calls = parser.feed(delta.text)
            if delta.finish_reason is not None:
                rest, more = parser.finish()
                text, calls = text + rest, calls + more
        has_ids = self.prompt_ids is not None and bool(delta.token_ids)
        if text or (self.texts is not None and delta.logprobs) or has_ids:
            choice = ChatChunkChoice(
                index=index,
                delta=ChatDelta(content=text),
                logprobs=self._logprobs(delta.logprobs),
                token_ids=self._ids(delta.token_ids),
            )
            out.append(self._chunk([choice], usage))
        if calls:
            deltas = [
                ToolCallDelta(index=num_before + k, id=c.id, function=_function(c))
                for k, c in enumerate(calls)
            ]
            out.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=deltas))], usage))
        if delta.finish_reason is not None:
            reason = with_calls(finish_reason(delta), [] if parser is None else parser.calls)
            last = ChatChunkChoice(
                index=index, delta=ChatDelta(), finish_reason=reason, stop_reason=delta.stop_reason
            )
            out.append(self._chunk([last], usage))
        return out

    def usage_chunk(self, usage: UsageInfo) -> object:
        return self._chunk([], usage)

    def whole(self, choices: Sequence[ChoiceResult], usage: UsageInfo) -> object:
        scored = UNSET if self.scoring is None else self.scoring.render(choices[0].prompt_logprobs)
        return ChatCompletion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[self._choice(c) for c in choices],
            usage=usage,
            service_tier=self.service_tier,
            prompt_logprobs=scored,
            prompt_token_ids=UNSET if self.prompt_ids is None else self.prompt_ids,
        )

    def _choice(self, c: ChoiceResult) -> ChatChoice:
        content: str | None = c.text
        calls: list[ParsedCall] = []
        if self.tools is not None:
            content, calls = parse_whole(self.tools, c.text)
        tool_calls = [ToolCall(id=call.id, function=_function(call)) for call in calls]
        if self.echo:
            content = self.echo + (content or "")
        return ChatChoice(
            index=c.index,
            message=AssistantMessage(role="assistant", content=content, tool_calls=tool_calls or None),
            logprobs=self._logprobs(c.logprobs),
            finish_reason=with_calls(c.finish_reason, calls),
            stop_reason=c.stop_reason,
            token_ids=self._ids(c.token_ids),
        )


def _function(call: ParsedCall) -> FunctionCall:
    return FunctionCall(name=call.name, arguments=call.arguments)


def with_calls(reason: FinishReason | None, calls: Sequence[ParsedCall]) -> FinishReason | None:
    """OpenAI's finish_reason for an answer that ended in tool calls: "tool_calls" when they are whole;
    a call cut short keeps the reason that cut it ("length", or "stop" for a stop string)."""
    return "tool_calls" if calls and calls[-1].whole and reason == "stop" else reason


class CompletionRenderer(DataEvents):
    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        texts: TokenTexts | None = None,
        echo: Sequence[EchoedPrompt] | None = None,
        n: int = 1,
        scoring: PromptScoring | None = None,
        num_top: int = 0,
        prompt_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """``echo``: each prompt, repeated before its choices' answers (``n`` choices a prompt, choice
        ``i`` of prompt ``i // n``), with its tokens' logprobs where ``texts`` is given, ``num_top``
        alternatives each (the answer's ``logprobs``); ``scoring``: vLLM's ``prompt_logprobs``, on each
        choice of a whole answer; ``prompt_ids``: each prompt's, for vLLM's ``return_token_ids``, on
        its choices (a stream's first chunk of each), with their token ids."""
        self.scoring = scoring
        self.prompt_ids = None if prompt_ids is None else [list(ids) for ids in prompt_ids]
        self._opened: set[int] = set()  # choices whose first chunk went out
        self.num_top = num_top
        self.request_id = request_id
        self.model = model
        self.include_usage = include_usage
        self.texts = texts
        self.echo = echo
        self.n = n
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # per choice: characters of logprob tokens streamed so far
        self._scored: dict[int, list[TokenLogprob]] = {}  # per choice yet to echo: its prompt's logprobs
        self._echoed_choices: set[int] = set()

    def _body(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> Completion:
        return Completion(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(self, index: int, entries: Sequence[TokenLogprob] | None) -> CompletionLogprobs | None:
        if self.texts is None:
            return None
        result = completion_logprobs(self.texts, entries or (), self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + sum(len(t) for t in result.tokens)
        return result

    def _echoed(
        self, index: int, text: str, entries: Sequence[TokenLogprob] | None, scored: Sequence[TokenLogprob]
    ) -> tuple[str, CompletionLogprobs | None]:
        """Choice ``index``'s text and logprobs from its start, its prompt echoed before them (without
        echo, as they are)."""
        if self.echo is None:
            return text, self._logprobs(index, entries)
        prompt = self.echo[index // self.n]
        if self.texts is None:
            return prompt.text + text, None
        # the worker scored with as many alternatives as the request's largest count: the echo's own
        scored = [
            e if len(e.top) <= self.num_top else msgspec.structs.replace(e, top=e.top[: self.num_top])
            for e in scored
        ]
        echoed = echo_logprobs(self.texts, prompt.first_token_id, scored)
        self._offsets[index] = len(prompt.text)
        answer = self._logprobs(index, entries)
        assert answer is not None
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(echoed, name).extend(getattr(answer, name))
        return prompt.text + text, echoed

    def opening(self, index: int) -> list[object]:
        return []  # text completions have no role chunk

    def _choice(
        self,
        index: int,
        text: str,
        logprobs: CompletionLogprobs | None,
        reason: FinishReason | None,
        token_ids: Sequence[int],
        *,
        first: bool,
        stop_reason: StopReason | UnsetType = UNSET,
    ) -> CompletionChoice:
        """One choice's body; with vLLM's ``return_token_ids``, its token ids and, where ``first``,
        its prompt's; ``stop_reason`` where it finished."""
        choice = CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=reason, stop_reason=stop_reason
        )
        if self.prompt_ids is not None:
            choice.token_ids = list(token_ids)
            if first:
                choice.prompt_token_ids = self.prompt_ids[index // self.n]
        return choice

    def chunks(self, index: int, delta: TokenDelta, usage: UsageInfo | None = None) -> list[object]:
        if self.echo is not None and index not in self._echoed_choices:  # the prompt goes first
            scored = self._scored.setdefault(index, [])
            if delta.prompt_logprobs:
                merge_prompt_logprobs(scored, delta.prompt_position, delta.prompt_logprobs)
            if not (delta.token_ids or delta.text or delta.finish_reason is not None):
                return []  # its prompt's logprobs so far: they go out with the echo
            text, logprobs = self._echoed(index, delta.text, delta.logprobs, self._scored.pop(index))
            self._echoed_choices.add(index)
        else:
            has_logprobs = self.texts is not None and bool(delta.logprobs)
            has_ids = self.prompt_ids is not None and bool(delta.token_ids)
            if not (delta.text or has_logprobs or has_ids or delta.finish_reason is not None):
                return []
            text, logprobs = delta.text, self._logprobs(index, delta.logprobs)
        first = index not in self._opened
        self._opened.add(index)
        reason = finish_reason(delta)
        stop = UNSET if reason is None else delta.stop_reason
        choice = self._choice(index, text, logprobs, reason, delta.token_ids, first=first, stop_reason=stop)
        return [self._body([choice], usage)]

    def usage_chunk(self, usage: UsageInfo) -> object:
        return self._body([], usage)

    def whole(self, choices: Sequence[ChoiceResult], usage: UsageInfo) -> object:
        out = []
        for c in choices:
            text, logprobs = self._echoed(c.index, c.text, c.logprobs, c.prompt_logprobs)
            choice = self._choice(
                c.index, text, logprobs, c.finish_reason, c.token_ids, first=True, stop_reason=c.stop_reason
            )
            if self.scoring is not None:
                choice.prompt_logprobs = self.scoring.render(c.prompt_logprobs)
            out.append(choice)
        return self._body(out, usage)
