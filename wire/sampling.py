"""Sampling parameters: one Struct, sent by the gateway in Submit, validated by both sides."""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from wire.errors import InvalidRequestError
from wire.structured import StructuredOutput

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # a stop string's length: it comes back as the answer's stop_reason
MAX_LOGIT_BIAS = 1024  # entries per request (OpenAI's API takes a few hundred)
MAX_ALLOWED_TOKENS = 1 << 18  # vLLM's allowed_token_ids: more than any vocabulary served here
MAX_BAD_WORDS = 256  # token sequences (a word is one or two: with and without a leading space)
MAX_BAD_WORD_TOKENS = 64
LOGIT_BIAS_RANGE = 100.0  # |bias| at most this, as OpenAI's API allows


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``logprobs`` is the number of top alternatives to
    return per generated token (``None``: no logprobs; 0: only the chosen token's).
    ``prompt_logprobs``: likewise for each prompt token after the first, its logprob given the tokens
    before it (the prompt is scored: computed whole, none of it read from the prefix cache); with it,
    ``max_tokens`` may be 0 (the prompt scored, nothing generated: the legacy API's ``echo``).
    ``logit_bias``: (token id, bias) pairs added to the logits before anything else, each bias in
    [-100, 100] (OpenAI's: -100 bans a token, 100 all but forces it).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's: EOS and the stop token ids cannot be sampled, and stop strings are not matched, before
    # this many tokens are out
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # vLLM's: the stop string that ended the text (or a stop token's text) kept at its end
    include_stop_str_in_output: bool = False
    # capped in the Struct too: a hostile Submit cannot make the decoder allocate more
    logit_bias: Annotated[tuple[tuple[int, float], ...], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = ()
    # What the answer must match (a JSON schema, regex, choice or grammar: wire/structured.py); the
    # worker masks every next token to what the grammar allows.
    structured: StructuredOutput | None = None
    # vLLM's: only these tokens may be sampled (None: any)
    allowed_token_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_ALLOWED_TOKENS)] | None = None
    # vLLM's ``bad_words`` as the gateway tokenized them: a sequence's last token cannot be sampled
    # where the output so far ends with the rest of it (a one-token sequence: never)
    bad_words: Annotated[
        tuple[Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_BAD_WORD_TOKENS)], ...],
        msgspec.Meta(max_length=MAX_BAD_WORDS),
    ] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, *, vocab_size: int, max_model_len: int, num_prompt_tokens: int) -> None:
        """Raise :class:`InvalidRequestError` naming the first field out of range."""
        least = 0 if self.prompt_logprobs is not None else 1  # 0: only the prompt, scored
        _require(self.max_tokens >= least, "max_tokens", f"must be at least {least}, got {self.max_tokens}")
        _require(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        room = max_model_len - num_prompt_tokens
        _require(
            self.max_tokens <= room,
            "max_tokens",
            f"{self.max_tokens} new tokens do not fit: the prompt has {num_prompt_tokens} tokens "
            f"and the model's context is {max_model_len}",
        )
        _require(
            _finite(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature",
            f"must be in [0, 100], got {self.temperature}",
        )
        _require(
            _finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}"
        )
        _require(self.top_k is None or self.top_k >= 1, "top_k", f"must be at least 1, got {self.top_k}")
        _require(
            _finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}"
        )
        _require(
            _finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"must be in (0, 10], got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_finite(value) and -2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _require(
            self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            "logprobs",
            f"must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}",
        )
        _require(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
            "prompt_logprobs",
            f"must be between 0 and {MAX_TOP_LOGPROBS}, got {self.prompt_logprobs}",
        )
        _require(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        _require(all(self.stop), "stop", "stop strings must not be empty")
        _require(
            all(len(s) <= MAX_STOP_CHARS for s in self.stop),
            "stop",
            f"a stop string has at most {MAX_STOP_CHARS} characters",
        )
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words", [t for word in self.bad_words for t in word]),
        ):
            bad_ids = [t for t in ids if not 0 <= t < vocab_size]
            _require(not bad_ids, name, f"ids outside the vocabulary of {vocab_size}: {bad_ids[:5]}")
        _require(self.allowed_token_ids != (), "allowed_token_ids", "must not be empty")
        _require(all(self.bad_words), "bad_words", "a word must have at least one token")
        _require(
            self.seed is None or 0 <= self.seed < 2**63, "seed", f"must be in [0, 2**63), got {self.seed}"
        )
        self._validate_logit_bias(vocab_size)

    def _validate_logit_bias(self, vocab_size: int) -> None:
        bias = self.logit_bias
        _require(
            len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}"
        )
        for token_id, value in bias:
            _require(
                0 <= token_id < vocab_size,
                "logit_bias",
                f"token id {token_id} is not in the vocabulary (ids 0 to {vocab_size - 1})",
            )
            _require(
                _finite(value) and -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE,
                "logit_bias",
                f"the bias of token {token_id} must be in [-100, 100], got {value}",
            )
        _require(len({t for t, _ in bias}) == len(bias), "logit_bias", "a token id appears twice")


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise InvalidRequestError(field, message)
