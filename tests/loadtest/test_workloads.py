"""Workloads: exact prompt lengths (chat template included), reproducible, the documented shapes.

Both tokenizer paths run: the mock model's bytes, and a tiny trained byte-level BPE folder standing in
for a model's tokenizer.json (conftest), checked against an independent encode of the rendered template.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from loadtest.prompt_text import PromptTokenizer, load_tokenizer
from loadtest.workloads import TIER_MIX, Api, Workload, WorkloadOptions, parse_range

SHAPED = ("chat", "long-context", "mixed-tiers")


@pytest.fixture(params=["bytes", "hf"])
def tokenizer(request: pytest.FixtureRequest, tiny_tokenizer_dir: Path) -> PromptTokenizer:
    return load_tokenizer("bytes" if request.param == "bytes" else str(tiny_tokenizer_dir), "any-model")


@pytest.mark.parametrize("name", SHAPED)
@pytest.mark.parametrize("api", list(Api))
def test_prompt_lengths_are_exact(tokenizer: PromptTokenizer, name: str, api: Api) -> None:
    workload = Workload(name, tokenizer, api, seed=1, options=WorkloadOptions(prompt_len=(40, 90)))
    lengths = set()
    for i in range(25):
        spec = workload.request(i)
        if api.takes_messages:  # chat, and the Responses API (the messages as its input)
            assert spec.messages is not None and spec.prompt is None
            measured = len(tokenizer.builder.chat_ids(spec.messages))
        else:
            assert spec.prompt is not None and spec.messages is None
            measured = len(tokenizer.builder.text_ids(spec.prompt))
        assert measured == spec.num_prompt_tokens
        assert 40 <= spec.num_prompt_tokens <= 90  # the target range is the whole prompt's
        lengths.add(spec.num_prompt_tokens)
    assert len(lengths) > 5  # drawn, not constant


def test_hf_lengths_match_an_independent_encode(tiny_tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_tokenizer_dir), "any-model")
    raw = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    workload = Workload("chat", tokenizer, Api.CHAT, seed=0, options=WorkloadOptions(prompt_len=(64, 64)))
    for i in range(10):
        spec = workload.request(i)
        assert spec.messages is not None
        text = (
            "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in spec.messages)
            + "<|im_start|>assistant\n"
        )
        assert len(raw.encode(text, add_special_tokens=False).ids) == 64 == spec.num_prompt_tokens


@pytest.mark.parametrize("name", [*SHAPED, "shared-prefix"])
def test_reproducible_by_seed(tokenizer: PromptTokenizer, name: str) -> None:
    def build(seed: int) -> list[object]:
        workload = Workload(name, tokenizer, Api.CHAT, seed, WorkloadOptions(prefix_len=100))
        return [workload.request(i) for i in range(8)]

    assert build(7) == build(7)
    assert build(7) != build(8)


def test_output_lengths_follow_the_override() -> None:
    workload = Workload(
        "chat", load_tokenizer("bytes", "mock"), Api.CHAT, 0, WorkloadOptions(output_len=(5, 9))
    )
    outputs = {workload.request(i).max_tokens for i in range(50)}
    assert outputs <= set(range(5, 10)) and len(outputs) > 2


def test_shared_prefix_groups_share_their_system_prompt(tokenizer: PromptTokenizer) -> None:
    options = WorkloadOptions(num_prefixes=3, prefix_len=200, prompt_len=(10, 30))
    workload = Workload("shared-prefix", tokenizer, Api.CHAT, 0, options)
    specs = [workload.request(i) for i in range(40)]
    systems = Counter(s.messages[0]["content"] for s in specs if s.messages)
    assert len(systems) == 3 and min(systems.values()) >= 5  # a few prefixes, each shared by many
    for system in systems:
        assert len(tokenizer.builder.text_ids(system)) >= 200
    users = {s.messages[1]["content"] for s in specs if s.messages}
    assert len(users) == 40  # every user's own question
    for spec in specs:
        assert spec.messages is not None
        assert len(tokenizer.builder.chat_ids(spec.messages)) == spec.num_prompt_tokens


def test_mixed_tiers_mix_and_profiles() -> None:
    workload = Workload("mixed-tiers", load_tokenizer("bytes", "mock"), Api.CHAT, 0, WorkloadOptions())
    specs = [workload.request(i) for i in range(400)]
    counts = Counter(s.tier for s in specs)
    for tier, (share, profile) in TIER_MIX.items():
        assert counts[tier] / len(specs) == pytest.approx(share, abs=0.07)
        for spec in (s for s in specs if s.tier == tier):
            assert profile.prompt[0] <= spec.num_prompt_tokens <= profile.prompt[1]
            assert profile.output[0] <= spec.max_tokens <= profile.output[1]


def test_dataset_cycles_and_keeps_tiers_and_lengths(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    lines = [{"prompt": "Tell me a joke.", "max_tokens": 7, "tier": "batch"}, {"messages": chat}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    tokenizer = load_tokenizer("bytes", "mock")
    workload = Workload("dataset", tokenizer, Api.CHAT, 0, WorkloadOptions(output_len=(3, 3), dataset=path))
    first, second, third = (workload.request(i) for i in range(3))
    assert first.messages == [{"role": "user", "content": "Tell me a joke."}]
    assert (first.tier, first.max_tokens) == ("batch", 7)
    assert (second.tier, second.max_tokens) == (None, 3)
    assert second.num_prompt_tokens == len(tokenizer.builder.chat_ids(chat))
    assert third.messages == first.messages  # cycles
    completions = Workload("dataset", tokenizer, Api.COMPLETIONS, 0, WorkloadOptions(dataset=path))
    assert completions.request(0).prompt == "Tell me a joke."
    with pytest.raises(ValueError, match="needs 'prompt'"):
        completions.request(1)


def test_bad_inputs_are_named() -> None:
    tokenizer = load_tokenizer("bytes", "mock")
    with pytest.raises(ValueError, match="unknown workload"):
        Workload("nope", tokenizer, Api.CHAT, 0, WorkloadOptions())
    with pytest.raises(ValueError, match="--dataset"):
        Workload("dataset", tokenizer, Api.CHAT, 0, WorkloadOptions())
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        load_tokenizer("auto", "no-such-model-anywhere")
    assert parse_range("64:512") == (64, 512) and parse_range("8") == (8, 8)
    with pytest.raises(ValueError):
        parse_range("9:3")
