"""IncrementalDetokenizer: properties over byte-fallback and byte-level tokenizers built in-test."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from worker.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
SPECIALS = ["<unk>", "<s>", "</s>"]

# Characters that take several bytes, several code points, or both: each one is a chance to cut a
# character in half.
TRICKY = [
    "中",
    "文",
    "字",
    "😀",
    "👍🏽",
    "👨\u200d👩\u200d👧",
    "e\u0301",
    "\u0915\u094d\u0937",  # Devanagari conjunct
    "مرحبا",
    "ß",
    "€",
    "\U0001f1eb\U0001f1f7",  # flag: two regional indicators
    " ",
    "\n",
    REPLACEMENT,  # a real U+FFFD in the text may pass through
]

text_strategy = st.lists(
    st.one_of(
        st.sampled_from(TRICKY),
        st.sampled_from(list("abcdefgh the")),
        st.characters(codec="utf-8"),  # utf-8 rules out lone surrogates,
    ),
    max_size=30,
).map("".join)


@functools.cache
def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-style SentencePiece tokenizer: "▁" for spaces, unknown characters as <0xNN> bytes."""
    pieces = ["▁", "▁the", "▁a", "the", "中文", "e\u0301", "😀", "ing", "▁hello"]
    pieces += list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'中é")
    vocab = [(s, 0.0) for s in SPECIALS]
    vocab += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    vocab += [(p, -1.0 - len(p) * 0.1) for p in dict.fromkeys(pieces)]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus München! Ça va très bien, merci.",
    "中文字符测试，这是一个句子。日本語のテキストも少し。",
    "Emoji 😀😃😄 and hands 👍🏽👋🏾 in a sentence.",
    "Ελληνικά και русский текст, עברית ועוד.",
    "Combining: e\u0301 a\u0300 n\u0303 — and café, naïve, coöperate.",
]


@functools.cache
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny GPT-2 style byte-level BPE (SmolLM2's kind), trained here so merges split characters."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        min_frequency=1,
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 3, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def decode(tokenizer: PreTrainedTokenizerFast, token_ids: list[int], skip_special: bool = True) -> str:
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special)
    assert isinstance(text, str)
    return text


def chunked(token_ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    chunks, start = [], 0
    for size in sizes:
        if start >= len(token_ids):
            break
        chunks.append(list(token_ids[start : start + size]))
        start += size
    if start < len(token_ids):
        chunks.extend([t] for t in token_ids[start:])
    return chunks


def stream(
    detokenizer: IncrementalDetokenizer, chunks: list[list[int]]
) -> tuple[list[str], str | None, int | None]:
    """Feed the chunks; return the deltas (flush last), the stop matched and the chunk it ended in."""
    deltas: list[str] = []
    for index, chunk in enumerate(chunks):
        delta = detokenizer.update(chunk)
        deltas.append(delta.text)
        if delta.stop_matched is not None:
            return deltas, delta.stop_matched, index
    deltas.append(detokenizer.flush())
    return deltas, detokenizer.stop_matched, None


def assert_streams_full_decode(
    tokenizer: PreTrainedTokenizerFast, token_ids: list[int], sizes: list[int], skip_special: bool = True
) -> None:
    full = decode(tokenizer, token_ids, skip_special)
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], skip_special_tokens=skip_special)
    deltas, stop, _ = stream(detokenizer, chunked(token_ids, sizes))
    assert stop is None
    assert "".join(deltas) == full == detokenizer.text
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert full.startswith(emitted)
        if REPLACEMENT not in full:
            assert REPLACEMENT not in delta


chunk_sizes = st.lists(st.integers(1, 4), max_size=40)
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(text=text_strategy, sizes=chunk_sizes, skip_special=st.booleans(), data=st.data())
def test_byte_fallback_stream_equals_full_decode(
    text: str, sizes: list[int], skip_special: bool, data: st.DataObject
) -> None:
    tokenizer = byte_fallback_tokenizer()
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    # Special tokens between pieces: skipped or spelled out, as decode() would. Not inside a run of
    # byte tokens: there decode() turns the whole broken run into U+FFFD, which no stream can foresee.
    tokens = tokenizer.convert_ids_to_tokens(token_ids)
    gaps = [
        i
        for i in range(len(tokens) + 1)
        if not (0 < i < len(tokens) and is_byte(tokens[i - 1]) and is_byte(tokens[i]))
    ]
    inserts = data.draw(st.lists(st.tuples(st.sampled_from(gaps), st.sampled_from([1, 2])), max_size=2))
    for gap, special_id in sorted(inserts, reverse=True):
        token_ids.insert(gap, special_id)
    assert_streams_full_decode(tokenizer, token_ids, sizes, skip_special)


@PROPERTY
@given(text=text_strategy, sizes=chunk_sizes)
def test_byte_level_stream_equals_full_decode(text: str, sizes: list[int]) -> None:
    tokenizer = byte_level_tokenizer()
    assert_streams_full_decode(tokenizer, tokenizer.encode(text, add_special_tokens=False), sizes)


@PROPERTY
@given(data=st.data(), sizes=chunk_sizes)
def test_byte_level_stream_equals_full_decode_for_arbitrary_ids(
    data: st.DataObject, sizes: list[int]
) -> None:
    # Byte-level decoding replaces only the invalid bytes, so even garbage (what a model can emit)
    # streams to exactly decode()'s text.
    tokenizer = byte_level_tokenizer()
    token_ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=30))
    assert_streams_full_decode(tokenizer, token_ids, sizes)


def reference_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Generation stops at the first position where some stop string ends; the longest one wins."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


@PROPERTY
@given(text=text_strategy, sizes=chunk_sizes, data=st.data(), byte_level=st.booleans())
def test_stop_strings_truncate_and_never_leak(
    text: str, sizes: list[int], data: st.DataObject, byte_level: bool
) -> None:
    tokenizer = byte_level_tokenizer() if byte_level else byte_fallback_tokenizer()
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    full = decode(tokenizer, token_ids)
    stops: list[str] = []
    for _ in range(data.draw(st.integers(1, 3))):
        if full and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[start : data.draw(st.integers(start + 1, min(len(full), start + 6)))])
        else:
            stops.append(data.draw(st.sampled_from(["xyz", "the", "中文", "😀", "\n\n", "é"])))
    expected_text, expected_stop = reference_stop(full, stops)

    chunks = chunked(token_ids, sizes)
    included = IncrementalDetokenizer(tokenizer, [], stop=stops, include_stop=True)
    output, stop, _ = stream(included, chunks)  # vLLM's include_stop_str_in_output: through the stop
    assert ("".join(output), stop) == (expected_text + (expected_stop or ""), expected_stop)

    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=stops)
    deltas, stop, stop_chunk = stream(detokenizer, chunks)
    output = "".join(deltas)
    assert (output, stop) == (expected_text, expected_stop)
    assert output == detokenizer.text
    for s in stops:
        assert s not in output
    if stop_chunk is not None:
        # Nothing comes out after the match, whatever is fed.
        for chunk in chunks[stop_chunk + 1 :]:
            assert detokenizer.update(chunk).text == ""
        assert detokenizer.flush() == ""
        assert detokenizer.text == expected_text


def is_byte(token: str) -> bool:
    return token.startswith("<0x") and len(token) == 6


def encode_bytes(tokenizer: PreTrainedTokenizerFast, data: bytes) -> list[int]:
    ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in data])
    assert isinstance(ids, list)
    return ids


def test_partial_character_is_held_until_complete() -> None:
    tokenizer = byte_fallback_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = [detokenizer.update([t]).text for t in encode_bytes(tokenizer, "a字".encode())]
    assert deltas == ["a", "", "", "字"]


def test_incomplete_character_at_the_end_is_released_by_flush() -> None:
    tokenizer = byte_fallback_tokenizer()
    token_ids = encode_bytes(tokenizer, "字".encode()[:2])
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.update(token_ids).text == ""
    assert detokenizer.flush() == tokenizer.decode(token_ids) == REPLACEMENT * 2


def test_possible_stop_prefix_is_held_then_released() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["</answer>"])
    deltas = [detokenizer.update(tokenizer.encode(piece)) for piece in ["yes", " </", "ans", "we", "red"]]
    assert [d.text for d in deltas] == ["yes", " ", "", "", "</answered"]
    assert all(d.stop_matched is None for d in deltas)


def test_stop_string_across_tokens_ends_the_output() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["</answer>"])
    deltas = [detokenizer.update(tokenizer.encode(p)) for p in ["yes", " </", "answer", "> more"]]
    assert [(d.text, d.stop_matched) for d in deltas] == [
        ("yes", None),
        (" ", None),
        ("", None),
        ("", "</answer>"),
    ]
    assert detokenizer.text == "yes " and detokenizer.stop_matched == "</answer>"
    assert detokenizer.update(tokenizer.encode("more")).text == ""


def test_earliest_ending_stop_wins_regardless_of_chunking() -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode("xabcdy")
    for sizes in ([len(token_ids)], [1] * len(token_ids)):
        detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["abcd", "bc"])
        deltas, stop, _ = stream(detokenizer, chunked(token_ids, sizes))
        assert ("".join(deltas), stop) == ("xa", "bc")


@pytest.mark.parametrize("skip_special", [True, False])
def test_special_tokens_follow_skip_special_tokens(skip_special: bool) -> None:
    tokenizer = byte_level_tokenizer()
    token_ids = [*tokenizer.encode("hi"), tokenizer.eos_token_id]
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special)
    text = "".join(detokenizer.update([t]).text for t in token_ids) + detokenizer.flush()
    assert text == ("hi" if skip_special else "hi<|endoftext|>")


def test_sentencepiece_spaces_inside_the_stream_survive_the_window() -> None:
    tokenizer = byte_fallback_tokenizer()
    token_ids = tokenizer.encode("the a the hello", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detokenizer.update([t]).text for t in token_ids) + detokenizer.flush()
    assert text == "the a the hello"
