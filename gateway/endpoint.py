"""What differs between ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``, as data;
the rest is one path.

    body ─▶ decode ─▶ Prompts (chat: the messages, one prompt; completions: texts or token ids, one or more)
         ─▶ tokenize(builder of the placed model) ─▶ renderer (chat.completion, text_completion or
            response shapes)

The Responses API decodes into the chat request it stands for (gateway/responses_requests.py), so it
takes the chat prompts; only its renderer and the names its errors give fields differ. gateway/app.py
runs all three through one handler, gateway/placement.py places them the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from gateway.chat_prompt import chat_prompt, template_messages
from gateway.errors import APIError
from gateway.openai_api import ChatRenderer, CompletionRenderer, Renderer, Rendering
from gateway.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_chat,
    decode_completion,
)
from gateway.responses_api import renderer as responses_renderer
from gateway.responses_requests import ResponsesChat, decode_responses, responses_field
from gateway.tokenizer import PromptBuilder, TemplateError, text_ids_async
from gateway.tools import ToolSpec

Body = TypeVar("Body", bound=ChatCompletionRequest | CompletionRequest)


@dataclass(frozen=True, slots=True)
class Prompts:
    """What one request asks to complete, before it is tokenized for the model it is placed on."""

    param: str  # the body field they came from, which errors about them name
    content: object  # as the client sent them, for the span when content capture is on
    num_prompts: int  # each one runs ``n`` choices
    has_token_ids: bool  # sent as token ids: only the tokenizer that made them can run them
    texts: list[str | None]  # each prompt's text as the client sent it (None: token ids, or truncated)
    tokenize: Callable[[PromptBuilder], Awaitable[list[list[int]]]]  # in a thread, never on the loop
    keep_last: int | None = None  # vLLM's truncate_prompt_tokens: keep only a prompt's last tokens

    def truncated(self, prompt_ids: list[list[int]], context: int) -> list[list[int]]:
        """Each prompt's last ``keep_last`` tokens; -1: as many as leave one token of ``context``."""
        if self.keep_last is None:
            return prompt_ids
        keep = context - 1 if self.keep_last == -1 else self.keep_last
        return [ids[-keep:] if len(ids) > keep else ids for ids in prompt_ids]


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[Body]):
    path: str
    decode: Callable[[bytes], Body]  # raises InvalidRequestError naming the field
    prompts: Callable[[Body, int], Prompts]  # at most that many prompts; raises InvalidRequestError
    wants_logprobs: Callable[[Body], bool]
    renderer: Callable[[Body, Rendering], Renderer]
    tool_spec: Callable[[Body], ToolSpec | None]
    service_tier: Callable[[Body], str | None]  # OpenAI's service_tier field (the legacy API has none)
    id_prefix: str  # of the response's id, its separator included
    operation: str  # gen_ai.operation.name
    field_name: Callable[[str], str] = str  # a field as this API names it, in errors (chat's name given)
    echo: Callable[[Body], bool] = lambda body: False  # the legacy API's: the prompts repeated in the answer
    prompt_logprobs: Callable[[Body], int | None] = lambda body: None  # vLLM's: the prompt's logprobs
    return_token_ids: Callable[[Body], bool] = lambda body: False  # vLLM's: prompt and answer token ids


def chat_prompts(body: ChatCompletionRequest, max_prompts: int) -> Prompts:
    """The messages, content flattened to text, as one prompt through the placed model's chat template:
    tools, earlier calls and tool results through the template where it takes tools, else in the
    default tool format (gateway/tools.py)."""
    spec = body.tool_spec()
    messages = template_messages(body.messages, spec)  # bad calls in the history: a 400 now
    options = body.chat_options()

    async def tokenize(builder: PromptBuilder) -> list[list[int]]:
        rendered, tools = chat_prompt(body.messages, spec, builder.supports_tools)
        try:
            return [await asyncio.to_thread(builder.chat_ids, rendered, options, tools)]
        except TemplateError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from None

    return Prompts("messages", messages, 1, False, [None], tokenize, body.truncation())


def completion_prompts(body: CompletionRequest, max_prompts: int) -> Prompts:
    """Text prompts, or token-id prompts taken as they are."""
    prompts = body.prompts(max_prompts)
    specials = body.add_special_tokens

    async def tokenize(builder: PromptBuilder) -> list[list[int]]:
        return [
            await text_ids_async(builder, prompt, specials) if isinstance(prompt, str) else list(prompt)
            for prompt in prompts
        ]

    keep_last = body.truncation()
    has_token_ids = not all(isinstance(prompt, str) for prompt in prompts)
    # a truncated prompt is echoed as its tokens decoded: the text sent is not what ran
    texts = [prompt if isinstance(prompt, str) and keep_last is None else None for prompt in prompts]
    return Prompts("prompt", prompts, len(prompts), has_token_ids, texts, tokenize, keep_last)


CHAT: Endpoint[ChatCompletionRequest] = Endpoint(
    path="/v1/chat/completions",
    decode=decode_chat,
    prompts=chat_prompts,
    wants_logprobs=lambda body: body.logprobs,
    renderer=lambda body, r: ChatRenderer(
        r.request_id,
        r.model,
        body.include_usage,
        r.texts,
        r.tools,
        r.service_tier,
        r.scoring,
        None if r.prompt_ids is None else r.prompt_ids[0],
        body.echoed(),
    ),
    tool_spec=lambda body: body.tool_spec(),
    service_tier=lambda body: body.service_tier,
    id_prefix="chatcmpl-",
    operation="chat",
    prompt_logprobs=lambda body: body.prompt_logprobs,
    return_token_ids=lambda body: body.return_token_ids,
)
COMPLETIONS: Endpoint[CompletionRequest] = Endpoint(
    path="/v1/completions",
    decode=decode_completion,
    prompts=completion_prompts,
    wants_logprobs=lambda body: body.logprobs is not None,  # the legacy API: a count, 0 included
    renderer=lambda body, r: CompletionRenderer(
        r.request_id,
        r.model,
        body.include_usage,
        r.texts,
        r.echo,
        body.n,
        r.scoring,
        body.logprobs or 0,
        r.prompt_ids,
    ),
    tool_spec=lambda body: None,
    service_tier=lambda body: None,
    id_prefix="cmpl-",
    operation="text_completion",
    echo=lambda body: body.echo,
    prompt_logprobs=lambda body: body.prompt_logprobs,
    return_token_ids=lambda body: body.return_token_ids,
)
RESPONSES: Endpoint[ResponsesChat] = Endpoint(
    path="/v1/responses",
    decode=decode_responses,
    prompts=chat_prompts,
    wants_logprobs=lambda body: body.logprobs,
    renderer=responses_renderer,
    tool_spec=lambda body: body.tool_spec(),
    service_tier=lambda body: body.service_tier,
    id_prefix="resp_",
    operation="chat",
    field_name=responses_field,
)
