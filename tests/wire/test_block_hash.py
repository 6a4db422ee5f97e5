from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from wire.block_hash import hash_block, hash_blocks

tokens = st.lists(st.integers(0, 50_000), max_size=80)


@given(tokens, st.sampled_from([None, "a", "b"]))
def test_incremental_hashing_equals_one_shot(token_ids: list[int], salt: str | None) -> None:
    full = hash_blocks(token_ids, 16, salt)
    assert len(full) == len(token_ids) // 16
    if len(full) >= 2:
        rest = hash_blocks(token_ids, 16, salt, parent=full[0], start_block=1)
        assert rest == full[1:]


@given(tokens, tokens)
def test_equal_hash_iff_equal_prefix(a: list[int], b: list[int]) -> None:
    ha, hb = hash_blocks(a, 4), hash_blocks(b, 4)
    for i, (x, y) in enumerate(zip(ha, hb, strict=False)):
        assert (x == y) == (a[: (i + 1) * 4] == b[: (i + 1) * 4])


@given(tokens, st.integers(0, 90))
def test_an_answers_blocks_never_hash_as_a_prompts(token_ids: list[int], num_prompt: int) -> None:
    """From the block that holds a request's first output token on, its chain parts from the same
    tokens hashed as a prompt (the gateway's, a later request's); incremental equals one shot."""
    as_prompt = hash_blocks(token_ids, 4)
    with_outputs = hash_blocks(token_ids, 4, num_prompt_tokens=num_prompt)
    for i, (x, y) in enumerate(zip(as_prompt, with_outputs, strict=True)):
        assert (x == y) == ((i + 1) * 4 <= num_prompt)
    if len(with_outputs) >= 2:
        rest = hash_blocks(token_ids, 4, parent=with_outputs[0], start_block=1, num_prompt_tokens=num_prompt)
        assert rest == with_outputs[1:]


@given(tokens, st.integers(0, 90), st.integers(0, 90))
def test_where_the_outputs_begin_is_part_of_the_chain(token_ids: list[int], a: int, b: int) -> None:
    ha, hb = hash_blocks(token_ids, 4, num_prompt_tokens=a), hash_blocks(token_ids, 4, num_prompt_tokens=b)
    for i, (x, y) in enumerate(zip(ha, hb, strict=True)):
        assert (x == y) == (a == b or (i + 1) * 4 <= min(a, b))


def test_salt_separates_chains_and_hashes_are_stable() -> None:
    block = list(range(16))
    assert hash_block(None, block, "t1") != hash_block(None, block, "t2")
    assert hash_block(None, block, None) != hash_block(None, block, "")
    # Gateways and workers on different machines and Python versions must agree: pin one value.
    assert hash_block(None, [1, 2, 3], None).hex() == "77c35ae266e94853af98e983592e3f29"
    assert len(hash_block(None, block)) == 16
