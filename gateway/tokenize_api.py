"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt's token ids as this server feeds them, and back.

    POST /tokenize    {"model", "prompt", "add_special_tokens"}                   a completion prompt
                      {"model", "messages", "add_generation_prompt": true,        a chat, templated
                       "continue_final_message", "chat_template_kwargs"}
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model", "tokens"} -> {"prompt"}

The request and response shapes are vLLM's. Tokens are counted as ``/v1/completions`` and
``/v1/chat/completions`` would feed them to the model, with the same fields and defaults (a text
prompt's special tokens as its tokenizer adds them by default; a chat's only the template's);
``max_model_len`` is the longest context of the model's workers. The same API
keys as the completion routes; unknown fields are a 400, not ignored.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from gateway.body_decoding import decode_body
from gateway.chat_messages import ChatMessage, check_messages
from gateway.chat_prompt import chat_prompt
from gateway.openai_requests import chat_options
from gateway.state import Gateway
from gateway.tokenizer import ChatOptions
from gateway.tools import ToolDef, tool_spec
from wire.errors import InvalidRequestError

MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None  # as the chat endpoint puts them in the prompt (tool_choice auto)
    add_special_tokens: bool | None = None  # a prompt: as its tokenizer encodes by default; a chat: false
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt", "give either prompt or messages")
        if self.messages is not None:
            if not self.messages:
                raise InvalidRequestError("messages", "must contain at least one message")
            check_messages(self.messages)
            self.chat_options()
        else:
            for name in ("tools", "chat_template_kwargs"):
                if getattr(self, name) is not None:
                    raise InvalidRequestError(name, "goes with messages, not a prompt")
            if self.continue_final_message or not self.add_generation_prompt:
                name = "continue_final_message" if self.continue_final_message else "add_generation_prompt"
                raise InvalidRequestError(name, "goes with messages, not a prompt")
        tool_spec(self.tools, None, None)

    def chat_options(self) -> ChatOptions:
        assert self.messages is not None
        return chat_options(
            self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            add_special_tokens=bool(self.add_special_tokens),
            template_kwargs=self.chat_template_kwargs,
        )


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # each token's bytes as text (invalid UTF-8 replaced)


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


def decode_tokenize(raw: bytes) -> TokenizeRequest:
    body = decode_body(raw, TokenizeRequest)
    body.check()
    return body


def decode_detokenize(raw: bytes) -> DetokenizeRequest:
    return decode_body(raw, DetokenizeRequest)


async def tokenize(gateway: Gateway, body: TokenizeRequest) -> TokenizeResponse:
    builder = gateway.builder(body.model)  # 404 for a model not served here
    max_model_len = gateway.longest_context(body.model)
    if body.messages is not None:
        messages, tools = chat_prompt(
            body.messages, tool_spec(body.tools, None, None), builder.supports_tools
        )
        ids = await asyncio.to_thread(builder.chat_ids, messages, body.chat_options(), tools)
    else:
        assert body.prompt is not None
        ids = await asyncio.to_thread(builder.text_ids, body.prompt, body.add_special_tokens)
    strs = None
    if body.return_token_strs:
        strs = [builder.token_bytes(t).decode("utf-8", "replace") for t in ids]
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


async def detokenize(gateway: Gateway, body: DetokenizeRequest) -> DetokenizeResponse:
    builder = gateway.builder(body.model)
    if len(body.tokens) > MAX_DETOKENIZE_TOKENS:
        raise InvalidRequestError("tokens", f"at most {MAX_DETOKENIZE_TOKENS} tokens")
    vocab = builder.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError("tokens", f"token ids outside the vocabulary: {bad[:5]}")
    return DetokenizeResponse(prompt=await asyncio.to_thread(builder.decode, body.tokens))
