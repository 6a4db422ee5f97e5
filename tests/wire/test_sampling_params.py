from __future__ import annotations

import msgspec
import pytest

from wire.errors import InvalidRequestError
from wire.sampling import SamplingParams


def check(params: SamplingParams, prompt: int = 10) -> None:
    params.validate(vocab_size=100, max_model_len=64, num_prompt_tokens=prompt)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 55}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ("x" * 1025,)}, "stop"),
        ({"stop_token_ids": (100,)}, "stop_token_ids"),
        ({"allowed_token_ids": ()}, "allowed_token_ids"),
        ({"allowed_token_ids": (3, 100)}, "allowed_token_ids"),
        ({"bad_words": ((5, 100),)}, "bad_words"),
        ({"bad_words": ((),)}, "bad_words"),
        ({"seed": -1}, "seed"),
    ],
)
def test_out_of_range_values_name_their_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check(SamplingParams(**kwargs))  # type: ignore[arg-type]
    assert info.value.field == field
    assert field in str(info.value)


def test_defaults_are_valid_and_round_trip_through_msgpack() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, stop=("\n",), seed=3)
    check(params)
    assert params.is_greedy
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params


def test_unknown_fields_are_rejected() -> None:
    with pytest.raises(msgspec.ValidationError, match="best_of"):
        msgspec.json.decode(b'{"max_tokens": 3, "best_of": 2}', type=SamplingParams)


def test_logit_bias_names_the_field_for_unknown_ids_and_values_out_of_range() -> None:
    def check(bias: tuple[tuple[int, float], ...]) -> None:
        SamplingParams(logit_bias=bias).validate(vocab_size=100, max_model_len=64, num_prompt_tokens=4)

    check(((0, -100.0), (99, 100.0), (5, 0.5)))
    for bias, message in [
        (((100, 1.0),), r"token id 100 is not in the vocabulary \(ids 0 to 99\)"),
        (((-1, 1.0),), "token id -1 is not in the vocabulary"),
        (((1, 1e30),), r"the bias of token 1 must be in \[-100, 100\], got 1e\+30"),
        (((1, float("nan")),), "must be in"),
        (((1, 1.0), (1, 2.0)), "appears twice"),
    ]:
        with pytest.raises(InvalidRequestError, match=message) as info:
            check(bias)
        assert info.value.field == "logit_bias"
