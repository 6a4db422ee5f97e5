"""Prompt building at the gateway, without torch: chat template + tokenizer → prompt token ids.

For a Hugging Face folder this reproduces ``transformers``' ``apply_chat_template(..., tokenize=True)``
from its parts: the template is rendered in jinja2's immutable sandbox with the special tokens of
``tokenizer_config.json``, ``add_generation_prompt`` and the request's template variables, and the text
is encoded by the ``tokenizers`` library with ``add_special_tokens=False`` (the template already wrote
them) unless the request asks for them. With ``continue_final_message`` the text ends where the last
message's content does, as transformers cuts it: the model goes on with that message. For the
``mock`` model it is the shared byte tokenizer.

Tokenizing a long prompt takes milliseconds of CPU: the ``*_async`` methods run it in a thread so the
event loop keeps streaming other requests' tokens meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jinja2.ext
import jinja2.meta
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.tools import CallFormat, call_format
from wire.byte_tokenizer import BOS_ID, BYTE_OFFSET, VOCAB_SIZE, ByteTokenizer, token_name
from wire.errors import InvalidRequestError
from wire.sampling import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS

# {"role": ..., "content": ...}, content already flattened to text; with a template that takes tools,
# also an assistant's "tool_calls" and a tool message's "tool_call_id" (Hugging Face's conventions).
Message = Mapping[str, Any]

_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


# Variables the server gives a chat template from the request's own fields: its ``chat_template_kwargs``
# cannot set them (``add_generation_prompt`` they may: ``ChatOptions`` carries it).
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a chat's messages become its prompt (the names are transformers' and vLLM's)."""

    add_generation_prompt: bool = True  # the template opens the assistant's turn after the messages
    continue_final_message: bool = False  # the prompt ends inside the last message: the model goes on
    add_special_tokens: bool = False  # the tokenizer's own special tokens (a BOS) on top of the template's
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # more variables for the template


DEFAULT_CHAT = ChatOptions()


class PromptBuilder(Protocol):
    def chat_ids(
        self,
        messages: Sequence[Message],
        options: ChatOptions = DEFAULT_CHAT,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """``tools``: only for a builder whose template takes them (``supports_tools``). A template
        that refuses the messages, or a final message to continue that its text does not hold, is a
        :class:`TemplateError`."""
        ...

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (and tool calls and results) itself."""
        ...

    @property
    def call_format(self) -> CallFormat:
        """How the template teaches the model to write a call (gateway/tools.py; Hermes when it
        takes no tools: then the default tool prompt does the teaching)."""
        ...

    def text_ids(self, text: str, add_special_tokens: bool | None = False) -> list[int]:
        """``add_special_tokens`` None: as the tokenizer encodes text by default (a Hugging Face
        tokenizer adds its post-processor's special tokens, a BOS for Llama 3; SmolLM2's adds none)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens included (``/detokenize``)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (logprobs report them), perhaps part of a character."""
        ...


class BytePromptBuilder:
    """The mock model's prompts: the same ids its workers' MockTokenizer would produce."""

    def __init__(self) -> None:
        self._tokenizer = ByteTokenizer()

    def chat_ids(
        self,
        messages: Sequence[Message],
        options: ChatOptions = DEFAULT_CHAT,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The mock's template reads no variables (``options.template_kwargs`` change nothing, as they
        change nothing for a Hugging Face template that does not read them)."""
        assert tools is None, "the byte tokenizer's template has no tools"
        ids = self._tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
        )
        assert isinstance(ids, list)
        return [BOS_ID, *ids] if options.add_special_tokens else ids

    @property
    def supports_tools(self) -> bool:
        return False

    @property
    def call_format(self) -> CallFormat:
        return "hermes"

    def text_ids(self, text: str, add_special_tokens: bool | None = False) -> list[int]:
        # As Engine.add_request encodes a string prompt: no special tokens added (by default).
        return self._tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def token_bytes(self, token_id: int) -> bytes:
        if token_id >= BYTE_OFFSET:
            return bytes([token_id - BYTE_OFFSET])
        return token_name(token_id).encode()


class HFPromptBuilder:
    """A Hugging Face model folder's tokenizer.json + chat template, with no transformers import."""

    def __init__(self, folder: Path) -> None:
        self._tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = folder / "chat_template.jinja"
        source = template_path.read_text() if template_path.exists() else config.get("chat_template")
        if not isinstance(source, str):
            raise ValueError(f"{folder}: no chat template (chat_template.jinja or tokenizer_config.json)")
        # The environment transformers uses, so templates behave the same (whitespace, loop controls).
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(source)
        self._supports_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        self._call_format = call_format(source if self._supports_tools else None)
        self._special_tokens = {key: _token_text(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
        self._byte_level = type(self._tokenizer.decoder).__name__ == "ByteLevel"

    def render(
        self,
        messages: Sequence[Message],
        options: ChatOptions = DEFAULT_CHAT,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The template's text; the request's variables may set the special tokens' (as transformers
        lets its keyword arguments), not the ones the server sets."""
        assert not RESERVED_TEMPLATE_VARIABLES & options.template_kwargs.keys()
        extra = {} if tools is None else {"tools": [dict(t) for t in tools]}
        text = self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=options.add_generation_prompt,
            **extra,
            **{**self._special_tokens, **options.template_kwargs},
        )
        if options.continue_final_message:
            return _ending_in(text, str(messages[-1]["content"]))
        return text

    def chat_ids(
        self,
        messages: Sequence[Message],
        options: ChatOptions = DEFAULT_CHAT,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        return self.text_ids(self.render(messages, options, tools), options.add_special_tokens)

    @property
    def supports_tools(self) -> bool:
        return self._supports_tools

    @property
    def call_format(self) -> CallFormat:
        return self._call_format

    def text_ids(self, text: str, add_special_tokens: bool | None = False) -> list[int]:
        adds = True if add_special_tokens is None else add_special_tokens  # the library's default
        return list(self._tokenizer.encode(text, add_special_tokens=adds).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and token_id not in self._added_ids:
            # GPT-2 style: every byte was written as one printable character; undo that map.
            return bytes(_BYTE_OF_CHAR.get(ch, 0) for ch in piece)
        if _BYTE_FALLBACK.fullmatch(piece):  # SentencePiece's byte fallback, e.g. <0x0A>
            return bytes([int(piece[3:5], 16)])
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tokenizer.get_added_tokens_decoder())


def _ending_in(text: str, final: str) -> str:
    """``text`` cut just after the last message's content, as transformers' ``continue_final_message``
    cuts it: at its last occurrence, keeping the content's leading text as the template wrote it and
    its trailing whitespace only where the template kept it."""
    core = final.strip()
    if not core or core not in text:
        raise TemplateError(
            "continue_final_message: the template's text does not hold the last message's content to continue"
        )
    start = text.rindex(core)
    kept = final.lstrip()
    return text[: start + (len(kept) if text[start : start + len(kept)] == kept else len(core))]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map, which byte-level BPE vocabularies use."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_OF_CHAR = {ch: b for b, ch in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def bad_word_ids(builder: PromptBuilder, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as token sequences, as vLLM tokenizes them: each word as it would begin
    the text and, where a leading space makes it other tokens of the same count, as it would follow a
    space, so that it is barred at the start and in the middle of the text alike."""
    if len(words) > MAX_BAD_WORDS // 2:
        raise InvalidRequestError("bad_words", f"at most {MAX_BAD_WORDS // 2} words, got {len(words)}")
    out: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        bare = tuple(builder.text_ids(word.lstrip()))
        if not bare or len(bare) > MAX_BAD_WORD_TOKENS:
            why = "is empty" if not bare else f"has {len(bare)} tokens, more than {MAX_BAD_WORD_TOKENS}"
            raise InvalidRequestError(f"bad_words[{i}]", why)
        out.append(bare)
        spaced = tuple(builder.text_ids(" " + word.lstrip()))
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


async def chat_ids_async(builder: PromptBuilder, messages: Sequence[Message]) -> list[int]:
    return await asyncio.to_thread(builder.chat_ids, messages)


async def text_ids_async(
    builder: PromptBuilder, text: str, add_special_tokens: bool | None = False
) -> list[int]:
    return await asyncio.to_thread(builder.text_ids, text, add_special_tokens)


def _token_text(value: object) -> str:
    """Older configs write a special token as ``{"content": "<s>", ...}`` (an AddedToken)."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _tojson(value: object, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class TemplateError(ValueError):
    """The chat template refused the messages (for example, roles out of order): a client mistake."""
