"""Prompt token ids: the one rule the gateway, ``Submit.validate`` and ``Engine.add_request`` check."""

from __future__ import annotations

from collections.abc import Sequence

from wire.errors import InvalidRequestError


def check_prompt(
    prompt_ids: Sequence[int], *, vocab_size: int | None, max_model_len: int | None, field: str = "prompt"
) -> None:
    """Raise :class:`InvalidRequestError` naming ``field`` for the first of: no tokens; so many that the
    context has no room for one more; an id outside the vocabulary. A limit the caller does not know
    (None: a worker that reports no vocabulary size) is not checked."""
    num_prompt = len(prompt_ids)
    if num_prompt == 0:
        raise InvalidRequestError(field, "must contain at least one token")
    if max_model_len is not None and num_prompt >= max_model_len:
        raise InvalidRequestError(
            field, f"{num_prompt} tokens leave no room in the model's context of {max_model_len} tokens"
        )
    if vocab_size is not None:
        bad_ids = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad_ids:
            raise InvalidRequestError(field, f"token ids outside the vocabulary: {bad_ids[:5]}")
