"""The Responses API's answer shapes (``POST /v1/responses``), as msgspec Structs: the ``response``
object, its output items and usage, and the named events of a stream. Their rendering from TokenDeltas
is gateway/responses_api.py; the request, gateway/responses_requests.py. Torch-free.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.logprobs import ChatTokenLogprob
from gateway.openai_types import UsageInfo

# ---------------------------------------------------------------- the response object


class OutputText(msgspec.Struct, kw_only=True):
    type: str = "output_text"
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = msgspec.field(default_factory=list)


class MessageOut(msgspec.Struct, kw_only=True):
    type: str = "message"
    id: str
    status: str  # in_progress, completed, incomplete
    role: str = "assistant"
    content: list[OutputText]


class FunctionCallOut(msgspec.Struct, kw_only=True):
    type: str = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = MessageOut | FunctionCallOut


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # found in the prefix cache
    cache_write_tokens: int  # computed here, their K/V written to the cache


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, usage: UsageInfo) -> ResponseUsage:
        cached = usage.prompt_tokens_details.cached_tokens
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=cached, cache_write_tokens=usage.prompt_tokens - cached
            ),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(),
            total_tokens=usage.total_tokens,
        )


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class ResponseError(msgspec.Struct, kw_only=True):
    code: str  # OpenAI's codes for a failed response: server_error or rate_limit_exceeded here
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The request's settings echoed, as OpenAI's ``response`` object has them, and the answer."""

    id: str
    object: str = "response"
    created_at: int
    status: str  # in_progress, completed, incomplete, failed
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    top_logprobs: int | None
    truncation: str = "disabled"
    service_tier: str | None
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    reasoning: None = None
    user: str | None
    prompt_cache_key: str | None
    safety_identifier: str | None


# ---------------------------------------------------------------- the stream's events


class Event(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int


class ResponseEvent(Event, kw_only=True):  # created, in_progress, completed, incomplete, failed
    response: ResponseObject


class ItemEvent(Event, kw_only=True):  # output_item.added / .done
    output_index: int
    item: OutputItem


class PartEvent(Event, kw_only=True):  # content_part.added / .done
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText


class TextDeltaEvent(Event, kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[ChatTokenLogprob]


class TextDoneEvent(Event, kw_only=True):
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[ChatTokenLogprob]


class ArgumentsDeltaEvent(Event, kw_only=True):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(Event, kw_only=True):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(Event, kw_only=True):
    code: str | None
    message: str
    param: str | None
