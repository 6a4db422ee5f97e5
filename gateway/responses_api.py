"""The Responses API's answer (``POST /v1/responses``; its request: gateway/responses_requests.py; its
shapes: gateway/responses_types.py): one ``response`` object, or a stream of named events ending in it.

The answer's text becomes a ``message`` item of one ``output_text`` part; each tool call the model
made (parsed as on the chat endpoint, gateway/tool_calls.py) a ``function_call`` item, in the order
written. The status is ``completed``, or ``incomplete`` (``max_output_tokens``) when the limit cut the
answer. A stream, each event ``event: TYPE`` / ``data: {...}`` with a ``sequence_number`` counting from
0 and no ``[DONE]`` after the last::

    response.created, response.in_progress                       (the response, in_progress, no output)
    response.output_item.added      (a message item, when its first text comes)
    response.content_part.added     (its output_text part)
    response.output_text.delta ...  (the text as it streams)
    response.output_text.done, response.content_part.done, response.output_item.done
    response.output_item.added, response.function_call_arguments.delta / .done,
        response.output_item.done                                (each call, whole once its block closed)
    response.completed  or  response.incomplete                  (the whole response, usage included)

A request that fails midway ends with ``error`` and ``response.failed``. Torch-free.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from gateway.errors import ErrorBody
from gateway.logprobs import ChatTokenLogprob, TokenTexts, chat_logprobs
from gateway.openai_api import ChoiceResult, Rendering, finish_reason, with_calls
from gateway.openai_types import FinishReason, UsageInfo
from gateway.responses_requests import ResponsesChat, ResponsesRequest
from gateway.responses_types import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ErrorEvent,
    Event,
    FunctionCallOut,
    IncompleteDetails,
    ItemEvent,
    MessageOut,
    OutputItem,
    OutputText,
    PartEvent,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)
from gateway.tool_calls import AnswerParser, ParsedCall, answer_parser, parse_whole
from gateway.tools import ToolSpec
from wire.messages import TokenDelta, TokenLogprob

# ---------------------------------------------------------------- rendering


class ResponsesRenderer:
    """One request's answer as a ``response`` (``whole``) or its events (the Renderer protocol of
    gateway/openai_api.py). The Responses API has no ``n``: one choice, index 0."""

    def __init__(
        self,
        request_id: str,
        model: str,
        request: ResponsesRequest,
        texts: TokenTexts | None = None,
        tools: ToolSpec | None = None,
        service_tier: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.request = request
        self.texts = texts
        self.tools = tools if tools is not None and tools.in_prompt else None
        self.service_tier = service_tier
        self.created_at = int(time.time())
        self._sequence = 0
        self._output: list[OutputItem] = []
        self._message: MessageOut | None = None  # the message item being streamed
        self._parser: AnswerParser | None = None if self.tools is None else answer_parser(self.tools)
        self._finish: FinishReason | None = None

    # -- the whole answer

    def whole(self, choices: Sequence[ChoiceResult], usage: UsageInfo) -> ResponseObject:
        (choice,) = choices
        content: str | None = choice.text
        calls: list[ParsedCall] = []
        if self.tools is not None:
            content, calls = parse_whole(self.tools, choice.text)
        reason = with_calls(choice.finish_reason, calls)
        status = _status(reason)
        output: list[OutputItem] = []
        if content or not calls:  # text before calls ended where they began, as a stream has it
            text = OutputText(text=content or "", logprobs=self._logprobs(choice.logprobs))
            message_status = "completed" if calls else status
            output.append(MessageOut(id=_item_id("msg"), status=message_status, content=[text]))
        output.extend(_call_item(call, "completed" if call.whole else "incomplete") for call in calls)
        return self._response(status, output, usage, reason)

    # -- the stream

    def opening(self, index: int) -> list[object]:
        return [
            self._event(ResponseEvent, type="response.created", response=self._response("in_progress", [])),
            self._event(
                ResponseEvent, type="response.in_progress", response=self._response("in_progress", [])
            ),
        ]

    def chunks(self, index: int, delta: TokenDelta, usage: UsageInfo | None = None) -> list[object]:
        """``usage`` (vLLM's continuous usage) has no place in these events: the last one carries it."""
        text, calls = delta.text, list[ParsedCall]()
        if self._parser is not None:
            text, calls = self._parser.feed(delta.text)
            if delta.finish_reason is not None:
                rest, more = self._parser.finish()
                text, calls = text + rest, calls + more
        out: list[object] = []
        # Logprobs alone (no text yet) open the message only where no call can be in the making.
        if text or (self.texts is not None and delta.logprobs and self._parser is None):
            out += self._text(text, delta.logprobs)
        for call in calls:
            out += self._close_message()
            out += self._call(call)
        if delta.finish_reason is not None:
            parsed = [] if self._parser is None else self._parser.calls
            self._finish = with_calls(finish_reason(delta), parsed)
            if not self._output and self._message is None:  # an empty answer: an empty message
                out += self._text("", None)
            out += self._close_message()
        return out

    def closing(self, usage: UsageInfo) -> list[object]:
        status = _status(self._finish)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [
            self._event(
                ResponseEvent, type=kind, response=self._response(status, self._output, usage, self._finish)
            )
        ]

    def failure(self, error: ErrorBody, status: int) -> list[object]:
        detail = error.error
        failed = self._response("failed", self._output)
        kind = "rate_limit_exceeded" if status == 429 else "server_error"
        failed.error = ResponseError(code=kind, message=detail.message)
        return [
            self._event(
                ErrorEvent,
                type="error",
                code=detail.code or detail.type,
                message=detail.message,
                param=detail.param,
            ),
            self._event(ResponseEvent, type="response.failed", response=failed),
        ]

    def frame(self, payload: object) -> bytes:
        assert isinstance(payload, Event)
        return b"event: " + payload.type.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"

    @property
    def done(self) -> bytes:
        return b""  # the Responses API's stream ends with its last event

    # -- the pieces

    def _event(self, kind: type[Event], **fields: Any) -> Event:
        event = kind(sequence_number=self._sequence, **fields)
        self._sequence += 1
        return event

    def _text(self, text: str, entries: Sequence[TokenLogprob] | None) -> list[object]:
        out: list[object] = []
        message = self._message
        if message is None:  # the first text since the start or since a call: a new message item
            message = self._message = MessageOut(id=_item_id("msg"), status="in_progress", content=[])
            self._output.append(message)
            index = len(self._output) - 1
            out.append(
                self._event(
                    ItemEvent, type="response.output_item.added", output_index=index, item=_copy(message)
                )
            )
            part = OutputText(text="")
            out.append(
                self._event(
                    PartEvent,
                    type="response.content_part.added",
                    item_id=message.id,
                    output_index=index,
                    part=part,
                )
            )
            message.content.append(OutputText(text=""))
        logprobs = self._logprobs(entries)
        part = message.content[0]
        part.text += text
        part.logprobs += logprobs
        if text or logprobs:
            out.append(
                self._event(
                    TextDeltaEvent,
                    type="response.output_text.delta",
                    item_id=message.id,
                    output_index=self._output.index(message),
                    delta=text,
                    logprobs=logprobs,
                )
            )
        return out

    def _close_message(self) -> list[object]:
        message, self._message = self._message, None
        if message is None:
            return []
        message.status = "completed" if self._finish in (None, "stop", "tool_calls") else "incomplete"
        index = self._output.index(message)
        part = message.content[0]
        return [
            self._event(
                TextDoneEvent,
                type="response.output_text.done",
                item_id=message.id,
                output_index=index,
                text=part.text,
                logprobs=part.logprobs,
            ),
            self._event(
                PartEvent,
                type="response.content_part.done",
                item_id=message.id,
                output_index=index,
                part=part,
            ),
            self._event(ItemEvent, type="response.output_item.done", output_index=index, item=message),
        ]

    def _call(self, call: ParsedCall) -> list[object]:
        item = _call_item(call, "in_progress")
        self._output.append(item)
        index = len(self._output) - 1
        added = self._event(
            ItemEvent, type="response.output_item.added", output_index=index, item=_copy(item)
        )
        item.status = "completed" if call.whole else "incomplete"
        return [
            added,
            self._event(
                ArgumentsDeltaEvent,
                type="response.function_call_arguments.delta",
                item_id=item.id,
                output_index=index,
                delta=call.arguments,
            ),
            self._event(
                ArgumentsDoneEvent,
                type="response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                name=call.name,
                arguments=call.arguments,
            ),
            self._event(ItemEvent, type="response.output_item.done", output_index=index, item=item),
        ]

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> list[ChatTokenLogprob]:
        return [] if self.texts is None else chat_logprobs(self.texts, entries or ())

    def _response(
        self,
        status: str,
        output: list[OutputItem],
        usage: UsageInfo | None = None,
        reason: FinishReason | None = None,
    ) -> ResponseObject:
        request = self.request
        text_format = request.text.format if request.text is not None else None
        return ResponseObject(
            id=self.request_id,
            created_at=self.created_at,
            status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if reason == "length" else None,
            model=self.model,
            output=list(output),
            usage=None if usage is None else ResponseUsage.of(usage),
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {},
            parallel_tool_calls=request.parallel_tool_calls is not False,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
            tools=request.tools or [],
            text={
                "format": msgspec.to_builtins(text_format) if text_format is not None else {"type": "text"}
            },
            top_logprobs=request.top_logprobs,
            service_tier=self.service_tier,
            user=request.user,
            prompt_cache_key=request.prompt_cache_key,
            safety_identifier=request.safety_identifier,
        )


def renderer(body: ResponsesChat, r: Rendering) -> ResponsesRenderer:
    assert body.origin is not None, "a ResponsesChat comes from decode_responses"
    return ResponsesRenderer(r.request_id, r.model, body.origin, r.texts, r.tools, r.service_tier)


def _status(reason: FinishReason | None) -> str:
    return "incomplete" if reason == "length" else "completed"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _call_item(call: ParsedCall, status: str) -> FunctionCallOut:
    return FunctionCallOut(
        id=_item_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments, status=status
    )


def _copy(item: OutputItem) -> OutputItem:
    """An item as it is now (events are encoded when sent; the item changes after)."""
    return msgspec.convert(msgspec.to_builtins(item), type(item))
