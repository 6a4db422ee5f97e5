"""The OpenAI response bodies this gateway sends (chat completions, text completions, models), as
msgspec Structs: the API's shapes. Their rendering from TokenDeltas is gateway/openai_api.py; the
requests, gateway/openai_requests.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from gateway.logprobs import ChatLogprobs, CompletionLogprobs, PromptLogprobs
from wire.messages import Usage


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def total(cls, usages: Sequence[Usage], prompt_of: Sequence[int]) -> UsageInfo:
        """The usage of a request whose choice ``i`` ran prompt ``prompt_of[i]``. As OpenAI counts it: a
        prompt shared by ``n`` choices once, every choice's completion tokens."""
        prompts: dict[int, Usage] = {}
        for usage, prompt in zip(usages, prompt_of, strict=True):
            prompts.setdefault(prompt, usage)
        num_prompt = sum(u.prompt_tokens for u in prompts.values())
        num_cached = sum(u.cached_tokens for u in prompts.values())
        num_completion = sum(u.completion_tokens for u in usages)
        return cls(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
        )


FinishReason = Literal["stop", "length", "tool_calls"]


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class ToolCallDelta(msgspec.Struct, kw_only=True):
    """A call in a stream: sent whole, once its block has closed (``index`` counts the choice's calls)."""

    index: int
    id: str
    type: str = "function"
    function: FunctionCall


class AssistantMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``tool_calls`` is left out when there are none, as OpenAI does (hence no default on role)."""

    role: str
    content: str | None  # None: only tool calls
    tool_calls: list[ToolCall] | None = None


# vLLM's ``return_token_ids``: each choice's ``token_ids`` (a stream's: each chunk's own), and the
# prompt's ``prompt_token_ids`` (a chat's on the answer, a stream's on its first chunk; a completion's
# on each choice, a stream's on the choice's first chunk); left out where not asked for.
TokenIds = list[int] | UnsetType
# vLLM's ``stop_reason``: the stop string or stop token id that ended a choice (null for an EOS or a
# length); on every choice of a whole answer, on a stream's finishing chunk.
StopReason = str | int | None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    token_ids: TokenIds = UNSET


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    service_tier: str | None = None  # OpenAI's name of the tier it ran at (ServerConfig.service_tier_name)
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, where asked for (else left out)
    prompt_token_ids: TokenIds = UNSET


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason | UnsetType = UNSET
    token_ids: TokenIds = UNSET


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    service_tier: str | None = None
    prompt_token_ids: TokenIds = UNSET


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, where asked for (else left out)
    prompt_token_ids: TokenIds = UNSET
    token_ids: TokenIds = UNSET


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
    # vLLM's: the longest context of the model's workers (left out until one has registered), which
    # clients and benchmark tools read to size their prompts
    max_model_len: int | UnsetType = UNSET


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
