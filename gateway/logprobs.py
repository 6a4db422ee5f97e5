"""Token log-probabilities as OpenAI returns them, from the (token id, logprob) pairs workers send.

Workers send ids only; the text of a token is the gateway's business (it owns the tokenizer). Two
shapes, one per endpoint:

  chat:         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                 "bytes"}, ...]}, ...]}
  completions:  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
                 "text_offset": [...]}                                   (the legacy API)

A token's ``bytes`` are its exact UTF-8 bytes, which may be part of a character; its ``token`` text is
those bytes decoded with replacement characters, as OpenAI does.

A scored prompt's logprobs (the legacy API's ``echo`` with ``logprobs``) come from the worker a chunk at a
time, each from a prompt position on (``TokenDelta.prompt_position``): ``merge_prompt_logprobs`` keeps
each position once (a request moved to another worker is scored again from its start), and
``echo_logprobs`` puts them in the legacy shape, the first token's logprob ``null`` as OpenAI's is.
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


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's shape of one token of a scored prompt (its ``prompt_logprobs`` field)."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


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


def merge_prompt_logprobs(have: list[TokenLogprob], position: int, entries: Sequence[TokenLogprob]) -> None:
    """Add a scored prompt's ``entries`` from ``position`` on (1: its second token) to ``have``, the
    positions 1 .. ``len(have)`` so far, each position once."""
    if position > len(have) + 1:
        raise ValueError(f"prompt logprobs from position {position} after {len(have)}: one went missing")
    have.extend(entries[len(have) + 1 - position :])


def echo_logprobs(
    texts: TokenTexts, first_token_id: int, entries: Sequence[TokenLogprob]
) -> CompletionLogprobs:
    """An echoed prompt's tokens in the legacy shape: the first with no logprob (nothing precedes it),
    then ``entries``, the logprobs of the rest; ``text_offset`` from 0, each token's text after the
    one before."""
    text, _ = texts(first_token_id)
    result = completion_logprobs(texts, entries, len(text))
    result.tokens.insert(0, text)
    result.token_logprobs.insert(0, None)
    result.top_logprobs.insert(0, None)
    result.text_offset.insert(0, 0)
    return result


def vllm_prompt_logprobs(texts: TokenTexts, entries: Sequence[TokenLogprob], num_top: int) -> PromptLogprobs:
    """A scored prompt as vLLM's ``prompt_logprobs`` answers it: ``None`` for the first token, then for
    each token a map of token id (a string, as JSON keys are) to its logprob, rank and text: the prompt's
    token first, then the ``num_top`` most likely (ranks 1 ..), the prompt's token among them once."""
    out: PromptLogprobs = [None]
    for entry in entries:
        scored = {str(entry.token_id): _prompt_logprob(texts, entry.token_id, entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top[:num_top], start=1):
            scored.setdefault(str(token_id), _prompt_logprob(texts, token_id, logprob, rank))
        out.append(scored)
    return out


def _prompt_logprob(texts: TokenTexts, token_id: int, logprob: float, rank: int | None) -> PromptLogprob:
    return PromptLogprob(logprob=logprob, rank=rank, decoded_token=texts(token_id)[0])
