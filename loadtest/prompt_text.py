"""Prompt text of an exact token length, measured with the target model's own tokenizer.

The tokenizer is the one the server itself uses to build prompt ids (``gateway.tokenizer``: the model
folder's ``tokenizer.json`` and chat template, or the mock model's byte tokenizer), so the
``prompt_tokens`` a server reports for a request equals what the workload built. Text is made of
*pieces* whose token counts add up when concatenated:
  - a Hugging Face tokenizer: words that encode, with their leading space, to exactly one token (byte-level
    BPE pre-tokenizers split before every space, so " w1 w2 w3" is three tokens);
  - the byte tokenizer: words, one token per UTF-8 byte.
:func:`fit` then measures the whole prompt (chat template included) and corrects the free part until the
count is exact.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import tokenizers

from gateway.tokenizer import BytePromptBuilder, HFPromptBuilder, PromptBuilder

MOCK_MODEL = "mock"
MAX_FIT_ROUNDS = 6
_WORD = re.compile(r"Ġ[a-z]{3,10}")  # byte-level BPE writes a leading space as Ġ
_POOL_SIZE = 4000  # the lowest ids among such words: the commonest, so prompts read like text
_BYTE_SENTENCE = (
    "the model serves every request in its tier while the cache keeps shared prefixes warm and the "
    "scheduler batches prefill with decode so that interactive users see their first token quickly "
    "and nightly batches finish before morning without starving anyone of memory or time"
)
_BYTE_WORDS = _BYTE_SENTENCE.split()


class PieceSource(Protocol):
    def text(self, rng: random.Random, num_tokens: int) -> str:
        """Text of ``num_tokens`` tokens when encoded alone (no special tokens)."""
        ...


class WordPieces:
    """Single-token " word" pieces of a Hugging Face tokenizer."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        candidates = sorted((i, w) for w, i in tokenizer.get_vocab().items() if _WORD.fullmatch(w))
        words = [" " + w[1:] for _, w in candidates[: _POOL_SIZE * 2]]
        encoded = tokenizer.encode_batch(words, add_special_tokens=False)
        self.words = [w for w, e in zip(words, encoded, strict=True) if len(e.ids) == 1][:_POOL_SIZE]
        if len(self.words) < 100:
            raise ValueError("this tokenizer has too few single-token words to build prompts from")

    def text(self, rng: random.Random, num_tokens: int) -> str:
        return "".join(rng.choices(self.words, k=num_tokens))


class BytePieces:
    """The byte tokenizer: a token per UTF-8 byte, so any ASCII text of the right length."""

    def text(self, rng: random.Random, num_tokens: int) -> str:
        parts: list[str] = []
        left = num_tokens
        while left > 0:
            word = " " + rng.choice(_BYTE_WORDS)
            if len(word) > left:
                word = "a" * left  # the last few bytes
            parts.append(word)
            left -= len(word)
        return "".join(parts)


@dataclass(frozen=True, slots=True)
class PromptTokenizer:
    name: str  # "bytes", or the model folder
    builder: PromptBuilder  # measures: chat_ids (template included) and text_ids
    pieces: PieceSource


def load_tokenizer(spec: str, model_id: str) -> PromptTokenizer:
    """``spec``: "auto" (the mock model's bytes, else the served model's folder in the tierserve model
    cache), "bytes", or a Hugging Face model folder."""
    if spec == "bytes" or (spec == "auto" and model_id == MOCK_MODEL):
        return PromptTokenizer("bytes", BytePromptBuilder(), BytePieces())
    folder = Path(spec) if spec != "auto" else _cached_model_folder(model_id)
    if folder is None or not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json for model {model_id!r}: pass --tokenizer with the model's Hugging Face "
            "folder (or 'bytes' for a mock server)"
        )
    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    return PromptTokenizer(str(folder), HFPromptBuilder(folder), WordPieces(hf))


def _cached_model_folder(model_id: str) -> Path | None:
    """Where ``tierserve models pull`` keeps ``model_id`` (worker/models/store.py's layout; loadtest may
    not import the worker), or ``model_id`` itself when it names a folder."""
    if Path(model_id).is_dir():
        return Path(model_id)
    override = os.environ.get("TIERSERVE_CACHE")
    root = Path(override).expanduser() if override else Path.home() / ".cache" / "tierserve" / "models"
    folder = root / model_id
    return folder if folder.is_dir() else None


def fit(measure: Callable[[str], int], make_text: Callable[[int], str], target: int, fixed: int) -> str:
    """The free text whose prompt measures ``target`` tokens. ``fixed`` is a first guess at what the rest
    of the prompt (template, shared prefix) takes; ``make_text(n)`` must be deterministic in ``n``."""
    num_free = max(target - fixed, 1)
    for _ in range(MAX_FIT_ROUNDS):
        text = make_text(num_free)
        measured = measure(text)
        if measured == target or (measured > target and num_free == 1):
            return text
        num_free = max(num_free + target - measured, 1)
    raise ValueError(f"could not build a prompt of exactly {target} tokens (last try: {measured})")
