"""Token log-probabilities as OpenAI returns them, from the (token id, logprob) pairs workers send.

Workers send ids only; the text of a token is the gateway's business (it owns the tokenizer). Two
shapes, one per endpoint:

  chat:         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                 "bytes"}, ...]}, ...]}
  completions:  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
                 "text_offset": [...]}                                   (the legacy API)

A token's ``bytes`` are its exact UTF-8 bytes, which may be part of a character; its ``token`` text is
those bytes decoded with replacement characters, as OpenAI does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import msgspec

from wire.messages import TokenLogprob

TokenBytes = Callable[[int], bytes]
TOKEN_CACHE_SIZE = 1 << 16


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TokenTexts:
    """Token id → (text, bytes), cached: the same few thousand tokens recur in every response."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._lookup = functools.lru_cache(maxsize=TOKEN_CACHE_SIZE)(self._uncached(token_bytes))

    @staticmethod
    def _uncached(token_bytes: TokenBytes) -> Callable[[int], tuple[str, list[int]]]:
        def lookup(token_id: int) -> tuple[str, list[int]]:
            raw = token_bytes(token_id)
            return raw.decode("utf-8", errors="replace"), list(raw)

        return lookup

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        return self._lookup(token_id)


def chat_logprobs(texts: TokenTexts, entries: Sequence[TokenLogprob]) -> list[ChatTokenLogprob]:
    out = []
    for entry in entries:
        text, raw = texts(entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            top_text, top_raw = texts(token_id)
            top.append(TopLogprob(token=top_text, logprob=logprob, bytes=top_raw))
        out.append(ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top))
    return out


def completion_logprobs(
    texts: TokenTexts, entries: Sequence[TokenLogprob], start_offset: int
) -> CompletionLogprobs:
    """``start_offset``: characters of this choice's text before these tokens (for ``text_offset``)."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = start_offset
    for entry in entries:
        text, _ = texts(entry.token_id)
        result.tokens.append(text)
        result.token_logprobs.append(entry.logprob)
        # Two alternatives with the same text (a byte-level quirk) keep the likelier, listed first.
        top: dict[str, float] = {}
        for token_id, logprob in entry.top:
            top.setdefault(texts(token_id)[0], logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(text)
    return result
