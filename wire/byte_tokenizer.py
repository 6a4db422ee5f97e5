"""The byte-level tokenizer of the mock model, shared by the worker (``--mock``) and the gateway.

Pure Python (stdlib only), so the gateway can build prompts for mock workers without torch. Any text
round-trips, and a multi-byte character spans several tokens, so incremental detokenization runs for
real. Token ids::

    0 <|end|> (eos)   1 <|begin|> (bos)   2 <|pad|>   3 <|header|>   4 + b  byte b (0..255)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

SPECIAL_TOKENS = ("<|end|>", "<|begin|>", "<|pad|>", "<|header|>")
EOS_ID, BOS_ID, PAD_ID, HEADER_ID = range(len(SPECIAL_TOKENS))
BYTE_OFFSET = len(SPECIAL_TOKENS)
VOCAB_SIZE = BYTE_OFFSET + 256


class ByteTokenizer:
    """The subset of the Hugging Face tokenizer API that the engine, detokenizer and gateway call."""

    eos_token_id = EOS_ID
    bos_token_id = BOS_ID
    pad_token_id = PAD_ID
    eos_token = SPECIAL_TOKENS[EOS_ID]
    bos_token = SPECIAL_TOKENS[BOS_ID]
    pad_token = SPECIAL_TOKENS[PAD_ID]
    vocab_size = VOCAB_SIZE

    @property
    def all_special_ids(self) -> list[int]:
        return list(range(BYTE_OFFSET))

    @property
    def all_special_tokens(self) -> list[str]:
        return list(SPECIAL_TOKENS)

    def __len__(self) -> int:
        return VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Bytes of ``text`` (special-token names in it are plain text, never special ids)."""
        ids = [BYTE_OFFSET + b for b in text.encode("utf-8")]
        return [BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """Like a byte-level BPE: an incomplete UTF-8 sequence decodes to U+FFFD."""
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        parts: list[str] = []
        pending = bytearray()
        for token_id in ids:
            if not 0 <= token_id < VOCAB_SIZE:
                raise ValueError(f"token id {token_id} outside the mock vocabulary of {VOCAB_SIZE}")
            if token_id >= BYTE_OFFSET:
                pending.append(token_id - BYTE_OFFSET)
                continue
            # A special token ends any pending bytes: they cannot join bytes after it.
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special_tokens:
                parts.append(SPECIAL_TOKENS[token_id])
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def convert_ids_to_tokens(self, token_ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(token_ids, int):
            return token_name(token_ids)
        return [token_name(t) for t in token_ids]

    def apply_chat_template(
        self,
        messages: Iterable[Mapping[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        continue_final_message: bool = False,
    ) -> list[int] | str:
        """``<|begin|>``, ``<|header|>{role}\\n{content}<|end|>`` per message, then an open assistant turn;
        with ``continue_final_message`` the last message is left open instead (no ``<|end|>``)."""
        ids = [BOS_ID]
        for message in messages:
            ids += [HEADER_ID, *self.encode(f"{message['role']}\n{message['content']}"), EOS_ID]
        if continue_final_message:
            ids.pop()
        elif add_generation_prompt:
            ids += [HEADER_ID, *self.encode("assistant\n")]
        return ids if tokenize else self.decode(ids)


def hf_tokenizer_json() -> str:
    """This vocabulary as a Hugging Face ``tokenizer.json`` (a byte-level BPE without merges, so each
    byte is one token at ``BYTE_OFFSET + b``): for libraries that read that format, such as the
    grammar engine behind structured outputs."""
    byte_chars = _byte_level_alphabet()
    vocab = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    vocab.update({byte_chars[b]: BYTE_OFFSET + b for b in range(256)})
    special = [
        {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, name in enumerate(SPECIAL_TOKENS)
    ]  # fmt: skip
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    model: dict[str, object] = {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
        "vocab": vocab, "merges": [],
    }  # fmt: skip
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
        "decoder": byte_level, "model": model,
    })  # fmt: skip


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte (what byte-level BPE vocabularies are written in)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def token_name(token_id: int) -> str:
    return SPECIAL_TOKENS[token_id] if token_id < BYTE_OFFSET else f"<0x{token_id - BYTE_OFFSET:02X}>"
