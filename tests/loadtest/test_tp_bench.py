"""bench tp end to end on the tiny models (real gloo processes): its JSON and its equality verdict."""

from __future__ import annotations

import pytest

from loadtest.tp_bench import parse_args, prompts, run

pytestmark = pytest.mark.timeout(300)


def test_the_tiny_models_give_equal_tokens_at_tp2() -> None:
    figures = run(parse_args(["--no-embedded", "--max-tokens", "4", "--num-prompts", "3"]))
    assert figures["scenario"] == "tp" and figures["tensor_parallel_size"] == 2
    assert figures["tp_equal"] is True
    models = figures["models"]
    assert isinstance(models, list) and [m["model"] for m in models] == [
        "tiny-llama-gqa",
        "tiny-qwen2-one-kv-head",
    ]
    for row in models:
        assert row["tp_equal"] is True and row["output_tokens"] == 3 * 4
        assert row["steps_followed"] == [row["steps_sent"]]  # the follower ran every step rank 0 sent
        assert row["tok_s_tp1"] > 0 and row["tok_s_tp2"] > 0
    assert "embedded" not in figures  # not asked for


def test_prompts_are_fixed_and_of_different_lengths() -> None:
    batch = prompts(4, 256)
    assert batch == prompts(4, 256)
    assert sorted({len(p) for p in batch}) == [4, 13, 22, 31]
    assert all(3 <= t < 256 for p in batch for t in p)
