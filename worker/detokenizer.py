"""Incremental detokenization with stop strings: token ids in, safe-to-send text deltas out.

Two hold-backs stand between the decoded text and the client:

1. Incomplete UTF-8. A character split over several tokens (byte-fallback ``<0xE4>``, or a byte-level
   BPE piece ending mid-character) decodes to a trailing U+FFFD until its last byte arrives, so text
   ending in U+FFFD is not released yet.
2. Stop strings. Text that could still become the start of a stop string is kept until the next tokens
   rule it out; on a match the output ends right before the stop string (or right after it, with
   ``include_stop``: vLLM's ``include_stop_str_in_output``).

Decoding is windowed, as in vLLM and TGI: only ``ids[prefix_offset:]`` is decoded each step, and the new
text is what that window yields beyond ``ids[prefix_offset:read_offset]`` (already sent). The window
starts one segment back so that context-dependent decoding (SentencePiece's leading space) is right:

    ids:  … │ sent earlier │ last sent segment │ new, not yet sent │
                           ^prefix_offset      ^read_offset        ^len(ids)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DetokenizerDelta:
    text: str  # new text to send the client (may be "")
    stop_matched: str | None  # the stop string that ended the request, if any


class IncrementalDetokenizer:
    """Decodes one request's output tokens as they arrive.

    Invariant: ``text`` + held-back text == decode(output ids) (up to the first stop string), and no
    suffix of ``text`` is a prefix of a stop string, so a match can only begin in the held-back text.

    ``prompt_token_ids`` is not used as decoding context: the contract is that the output equals
    ``tokenizer.decode(output_ids)``, which a prompt-primed window would not give for SentencePiece
    tokenizers (it would keep the first token's leading space).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        assert all(stop), "stop strings must not be empty"
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset]), kept to decode once per step
        self._held = ""  # complete text kept back because it may start a stop string
        self._chunks: list[str] = []
        self._stop_matched: str | None = None

    def arm(self, stop: Sequence[str]) -> None:
        """Match ``stop`` from now on, in the text of the tokens after this (``min_tokens``: no stop
        string is matched before that many tokens are out); only while none is armed."""
        assert not self._stop and not self._held and all(stop), "stop strings armed once, non-empty"
        self._stop = tuple(stop)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._chunks)

    @property
    def stop_matched(self) -> str | None:
        return self._stop_matched

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerDelta:
        """Add tokens; return the text now safe to send. After a stop match, further tokens are ignored."""
        if self._stop_matched is not None:
            return DetokenizerDelta("", None)
        self._token_ids.extend(new_token_ids)
        return self._release(self._decode_new_text(), is_final=False)

    def flush(self) -> str:
        """At a finish for any reason but a stop string: release everything held back."""
        if self._stop_matched is not None:
            return ""
        window = self._decode(self._token_ids[self._prefix_offset :])
        tail = window[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._token_ids)
        self._prefix_text = ""
        return self._release(tail, is_final=True).text

    def _decode_new_text(self) -> str:
        """Text of the new tokens, or "" while it ends in an incomplete character."""
        window = self._decode(self._token_ids[self._prefix_offset :])
        if len(window) <= len(self._prefix_text) or window.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = window[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        return new_text

    def _release(self, new_text: str, *, is_final: bool) -> DetokenizerDelta:
        pending = self._held + new_text
        match = _first_stop(pending, self._stop)
        if match is not None:
            start, stop = match
            self._stop_matched = stop
            self._held = ""
            return self._emit(pending[: start + len(stop) if self._include_stop else start], stop)
        keep = 0 if is_final else _longest_stop_prefix_suffix(pending, self._stop)
        self._held = pending[len(pending) - keep :] if keep else ""
        return self._emit(pending[: len(pending) - keep], None)

    def _emit(self, text: str, stop_matched: str | None) -> DetokenizerDelta:
        if text:
            self._chunks.append(text)
        return DetokenizerDelta(text, stop_matched)

    def _decode(self, token_ids: list[int]) -> str:
        text = self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        assert isinstance(text, str)
        return text


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The stop string that ends first in ``text`` (the one generation would have hit first).

    Ranking by end, not start, makes the result independent of how the text arrived in chunks: with
    stops "abcd" and "bc", streaming "a", "b", "c" stops at "bc" before "abcd" could complete.
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop); on equal ends the longer one wins
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return None if best is None else (best[1], best[2])


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
