"""OpenAI's Responses API request (``POST /v1/responses``), read as the chat request it stands for.

Served statelessly: a request carries its whole conversation in ``input`` and nothing is kept after
the answer (``store`` false; ``previous_response_id``, ``conversation`` and ``item_reference`` items are
400s naming them). :func:`decode_responses` checks the body and turns it into a
:class:`ResponsesChat`, a chat request with the same messages, tools, output format and limits, which
runs the chat path (the model's chat template, tool calls, grammars); gateway/responses_api.py renders
its answer as a ``response`` object or as the API's stream of events::

    instructions                         → a system message, first
    input: "text"                        → one user message
    input items:
      {role, content} (type "message")   → a message of that role (user, system, developer, assistant);
                                           text parts (input_text, output_text, refusal) joined, any
                                           other part (images, files, audio) a 400
      {type: function_call, call_id, name, arguments}
                                         → a tool call of the assistant message before it, else of a
                                           new assistant message
      {type: function_call_output, call_id, output}
                                         → the tool message answering it
    tools [{type: function, name, ...}]  → chat's tools; hosted tools (web search, files, MCP) a 400
    tool_choice none | auto | required | {type: function, name}
    text.format text | json_object | json_schema {name, schema, strict}   → response_format
    max_output_tokens                    → max_completion_tokens
    include ["message.output_text.logprobs"], top_logprobs             → logprobs, top_logprobs
    priority, ignore_eos (vLLM's extensions)                            → as on chat

Keys inside items the server does not read pass (clients replay the ``output`` of an earlier response,
with its ``id``, ``status`` and ``annotations``); an unknown top-level field is a 400, as on the chat
endpoint. Errors name the Responses API's fields (``input[2].content[0].type``, ``text.format.schema``,
``max_output_tokens``): :func:`responses_field` renames what the chat path says.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from gateway.body_decoding import decode_body, invalid_field
from gateway.chat_messages import ChatMessage
from gateway.openai_requests import ChatCompletionRequest, JsonSchemaFormat, ResponseFormat
from gateway.tools import (
    NAME_PATTERN,
    FunctionCallIn,
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    ToolCallIn,
    ToolDef,
)
from wire.errors import InvalidRequestError
from wire.messages import MAX_PRIORITY

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one ``include`` value served
NOT_STORED = "responses are not stored here: send the whole conversation in input"


class Part(msgspec.Struct, kw_only=True):
    """A content part: text (``input_text``, or ``output_text`` replayed), a refusal, or one not served."""

    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Part]
    type: Literal["message"] = "message"


class FunctionCallItem(msgspec.Struct, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as a response's function_call item has it


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class FunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The Responses API's function tool: chat's ``{type, function: {...}}`` flattened."""

    type: Literal["function"]
    name: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``text.format``: chat's ``response_format`` with the json_schema's fields at its top level."""

    type: str = "text"
    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None

    def to_chat(self) -> ResponseFormat:
        schema = None
        if self.type == "json_schema":
            schema = JsonSchemaFormat(
                name=self.name, schema=self.schema, strict=self.strict, description=self.description
            )
        return ResponseFormat(type=self.type, json_schema=schema)


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # refused: no model here has a verbosity setting


class ResponsesStreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # only false: no padding is added to events


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None  # as on the chat endpoint (gateway.identity.with_service_tier)
    # Accepted, no effect, as on the chat endpoint.
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Served only at the values that keep nothing and change nothing (check_supported).
    store: bool | None = None
    background: bool | None = None
    truncation: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    reasoning: dict[str, Any] | None = None
    # vLLM's extensions, as on chat: the order within the tier; generate to the limit (load tests)
    priority: Annotated[int, msgspec.Meta(ge=-MAX_PRIORITY - 1, le=MAX_PRIORITY)] = 0
    ignore_eos: bool = False

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def check_supported(self) -> None:
        """The fields served only at some values, refused by name otherwise."""
        if self.store:
            raise InvalidRequestError("store", "responses are not stored here: send false or omit it")
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(name, NOT_STORED)
        if self.background:
            raise InvalidRequestError(
                "background", "background responses are not served: send false or omit it"
            )
        if self.truncation not in (None, "disabled"):
            raise InvalidRequestError(
                "truncation",
                f"only disabled is served (a prompt past the context is a 400), got {self.truncation!r}",
            )
        if self.reasoning is not None and any(v is not None for v in self.reasoning.values()):
            raise InvalidRequestError(
                "reasoning", "is not served: the models here do not reason before answering"
            )
        if self.text is not None and self.text.verbosity is not None:
            raise InvalidRequestError(
                "text.verbosity", "is not served: no model here has a verbosity setting"
            )
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise InvalidRequestError(
                "stream_options.include_obfuscation", "events are not padded here: send false or omit it"
            )
        for i, name in enumerate(self.include or ()):
            if name != LOGPROBS_INCLUDE:
                raise InvalidRequestError(f"include[{i}]", f"only {LOGPROBS_INCLUDE} is served, got {name!r}")

    def to_chat(self) -> ResponsesChat:
        """The chat request this one stands for; InvalidRequestError naming this API's fields."""
        messages, origins = self._messages()
        if self.top_logprobs is not None and not self.wants_logprobs:
            raise InvalidRequestError("top_logprobs", f'needs include ["{LOGPROBS_INCLUDE}"]')
        text_format = None if self.text is None or self.text.format is None else self.text.format.to_chat()
        chat = ResponsesChat(
            model=self.model,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            tools=self._tools(),
            tool_choice=self._tool_choice(),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=text_format,
            logprobs=self.wants_logprobs,
            top_logprobs=self.top_logprobs,
            service_tier=self.service_tier,
            user=self.user,
            metadata=self.metadata,
            prompt_cache_key=self.prompt_cache_key,
            safety_identifier=self.safety_identifier,
            priority=self.priority,
            ignore_eos=self.ignore_eos,
            origin=self,
        )
        try:
            chat.check_supported()
        except InvalidRequestError as exc:
            raise InvalidRequestError(responses_field(exc.field, origins), exc.message) from None
        return chat

    def _messages(self) -> tuple[list[ChatMessage], list[str]]:
        """The chat messages, and for each the field it came from (errors about it name that)."""
        messages: list[ChatMessage] = []
        origins: list[str] = []
        if self.instructions is not None:
            messages.append(ChatMessage(role="system", content=self.instructions))
            origins.append("instructions")
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
            origins.append("input")
            return messages, origins
        if not self.input:
            raise InvalidRequestError("input", "must contain at least one item")
        for i, item in enumerate(self.input):
            field = f"input[{i}]"
            kind = item.get("type", "message")
            if kind == "message":
                message = _convert(item, MessageItem, field)
                if message.role not in ROLES:
                    raise InvalidRequestError(
                        f"{field}.role", f"must be one of {', '.join(ROLES)}, got {message.role!r}"
                    )
                messages.append(ChatMessage(role=message.role, content=_text(message.content, field)))
                origins.append(field)
            elif kind == "function_call":
                call = _convert(item, FunctionCallItem, field)
                tool_call = ToolCallIn(
                    id=call.call_id, function=FunctionCallIn(name=call.name, arguments=call.arguments)
                )
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":  # its text, then its calls
                    last.tool_calls = [*(last.tool_calls or ()), tool_call]
                else:
                    messages.append(ChatMessage(role="assistant", tool_calls=[tool_call]))
                    origins.append(field)
            elif kind == "function_call_output":
                result = _convert(item, FunctionCallOutputItem, field)
                messages.append(
                    ChatMessage(
                        role="tool",
                        tool_call_id=result.call_id,
                        content=_text(result.output, field, "output"),
                    )
                )
                origins.append(field)
            elif kind == "item_reference":
                raise InvalidRequestError(
                    f"{field}.type", f"items are not stored here: send the item itself ({NOT_STORED})"
                )
            else:
                raise InvalidRequestError(
                    f"{field}.type", f"must be message, function_call or function_call_output, got {kind!r}"
                )
        return messages, origins

    def _tools(self) -> list[ToolDef] | None:
        if self.tools is None:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise InvalidRequestError(f"tools[{i}].type", f"only function tools are served, got {kind!r}")
            function = _convert(tool, FunctionTool, f"tools[{i}]")
            definition = FunctionDef(
                name=function.name,
                description=function.description,
                parameters=function.parameters,
                strict=function.strict,
            )
            tools.append(ToolDef(type="function", function=definition))
        return tools

    def _tool_choice(self) -> str | NamedToolChoice | None:
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError(
                "tool_choice",
                f'must be none, auto, required or {{"type": "function", "name": ...}}, got {choice}',
            )
        return NamedToolChoice(type="function", function=FunctionName(name=choice["name"]))


class ResponsesChat(ChatCompletionRequest, kw_only=True):
    """A Responses API request as the chat request it stands for; ``origin`` is what the client sent
    (the ``response`` object echoes its fields)."""

    origin: ResponsesRequest | None = None


def decode_responses(body: bytes) -> ResponsesChat:
    request = decode_body(body, ResponsesRequest)
    request.check_supported()
    return request.to_chat()


def _convert(value: object, kind: type[msgspec.Struct], field: str) -> Any:
    """``value`` as ``kind``; InvalidRequestError naming the path under ``field`` that does not fit."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise invalid_field(exc, field) from None


def _text(content: str | Sequence[Part], field: str, key: str = "content") -> str:
    """A message's text: its text parts joined (a refusal's text too); any other part a 400."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type == "refusal":
            texts.append(part.refusal or "")
        elif part.type in TEXT_PARTS:
            texts.append(part.text or "")
        else:
            raise InvalidRequestError(
                f"{field}.{key}[{j}].type", f"only text parts are served (input_text), got {part.type!r}"
            )
    return "".join(texts)


# The chat path's field names → this API's, longest first (a prefix is replaced, the rest kept).
_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("tool_choice.function", "tool_choice"),
    ("logprobs", "top_logprobs"),  # the count of alternatives, which this API calls top_logprobs
)
_MESSAGE = re.compile(r"^messages(?:\[(\d+)\])?")
_TOOL = re.compile(r"^tools\[(\d+)\]\.function")


def responses_field(field: str, origins: Sequence[str] = ()) -> str:
    """The Responses API's name for a field the chat path names: ``messages[k]`` → the input item it
    came from (``input`` without ``origins``), ``tools[i].function.name`` → ``tools[i].name``, and so on."""
    message = _MESSAGE.match(field)
    if message is not None:
        k = message.group(1)
        origin = origins[int(k)] if k is not None and int(k) < len(origins) else "input"
        return origin + field[message.end() :]
    tool = _TOOL.match(field)
    if tool is not None:
        return f"tools[{tool.group(1)}]" + field[tool.end() :]
    for old, new in _RENAMES:
        if field == old or field.startswith((old + ".", old + "[")):
            return new + field[len(old) :]
    return field
