"""check_prompt: the one rule for prompt token ids, and the same errors from every door that uses it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.wire.test_messages import submit
from wire.errors import InvalidRequestError
from wire.prompt import check_prompt

VOCAB = 100
CONTEXT = 64


@pytest.mark.parametrize(
    ("prompt_ids", "message"),
    [
        ([], "must contain at least one token"),
        ([1] * CONTEXT, f"{CONTEXT} tokens leave no room in the model's context of {CONTEXT} tokens"),
        ([1, VOCAB, -1, 2], f"token ids outside the vocabulary: {[VOCAB, -1]}"),
        ([VOCAB] * CONTEXT, f"{CONTEXT} tokens leave no room"),  # too long is told before bad ids
    ],
)
@pytest.mark.parametrize("field", ["prompt", "messages"])
def test_each_failure_has_one_message_naming_the_field(
    prompt_ids: list[int], message: str, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_prompt(prompt_ids, vocab_size=VOCAB, max_model_len=CONTEXT, field=field)
    assert info.value.field == field and info.value.message.startswith(message)
    assert str(info.value) == f"{field}: {info.value.message}"


def test_an_unknown_limit_is_not_checked_but_an_empty_prompt_always_is() -> None:
    check_prompt([10**9] * 1000, vocab_size=None, max_model_len=None)
    with pytest.raises(InvalidRequestError, match="at least one token"):
        check_prompt([], vocab_size=None, max_model_len=None)


@given(st.lists(st.integers(-3, VOCAB + 3), max_size=CONTEXT + 3))
def test_refused_exactly_when_empty_too_long_or_outside_the_vocabulary(prompt_ids: list[int]) -> None:
    is_bad = not prompt_ids or len(prompt_ids) >= CONTEXT or any(not 0 <= t < VOCAB for t in prompt_ids)
    try:
        check_prompt(prompt_ids, vocab_size=VOCAB, max_model_len=CONTEXT)
    except InvalidRequestError as exc:
        assert is_bad and exc.field == "prompt"
    else:
        assert not is_bad


@pytest.mark.parametrize("prompt_ids", [[], [1] * CONTEXT, [1, VOCAB]])
def test_submit_validate_refuses_a_prompt_with_check_prompts_own_error(prompt_ids: list[int]) -> None:
    with pytest.raises(InvalidRequestError) as expected:
        check_prompt(prompt_ids, vocab_size=VOCAB, max_model_len=CONTEXT)
    with pytest.raises(InvalidRequestError) as info:
        submit(prompt_token_ids=prompt_ids).validate(vocab_size=VOCAB, max_model_len=CONTEXT)
    assert (info.value.field, info.value.message) == (expected.value.field, expected.value.message)
