"""Greedy output of our engine, token for token against Hugging Face transformers (fp32).

The real embedded model, SmolLM2-135M-Instruct, on 16 varied chat prompts (5 to ~1,500 prompt
tokens, 64 new tokens): each alone; all in one batch; prefix caching on and off; and with a KV
cache so small that requests are preempted and recomputed. None of it may change greedy output.

Where fp32 arithmetic in a different order (batching, chunking) flips a near-tie, the two
sequences may diverge; that is accepted only with check_logprobs_close semantics: at the first
divergence each side's token must be within the other side's top-5. Everything after the first
divergence is then incomparable and not checked.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass

import pytest
import torch

from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import Engine
from worker.models.store import pull_default_model
from worker.policy_set import WorkerPolicies
from worker.request import TierRef

pytestmark = [pytest.mark.slow, pytest.mark.isa]

NEW_TOKENS = 64
TOP = 5

SYSTEM = (
    "You are a meticulous assistant for a logistics company. Always answer in short paragraphs, cite the "
    "relevant policy number when one applies, and never invent shipment data. " * 6
)
TOPICS = [
    "the water cycle",
    "how a bicycle gear works",
    "the history of the printing press",
    "photosynthesis",
    "why the sky is blue",
    "compound interest",
    "how vaccines train the immune system",
    "plate tectonics",
]


def long_document(rng: random.Random, num_sentences: int) -> str:
    subjects = [
        "The committee",
        "A small team",
        "The river",
        "Our warehouse",
        "The old library",
        "Each sensor",
    ]
    verbs = ["reviewed", "measured", "carried", "replaced", "documented", "ignored"]
    objects = [
        "the quarterly figures",
        "three crates of apples",
        "a faulty valve",
        "the winter schedule",
        "seventeen rare maps",
        "the night shift's notes",
    ]
    return " ".join(
        f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} on day {rng.randint(1, 365)}."
        for _ in range(num_sentences)
    )


RAW_PROMPTS = ["The capital of France", "1, 2, 3, 4,"]  # no chat template: 5-token prompts


def chat_prompts() -> list[list[dict[str, str]]]:
    rng = random.Random(1234)
    prompts: list[list[dict[str, str]]] = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about autumn leaves."}],
        [{"role": "user", "content": "List three prime numbers greater than 50."}],
        [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
        [{"role": "user", "content": "def fib(n):\n    # complete this Python function\n"}],
    ]
    for topic in TOPICS[:4]:  # shared long system prompt: prefix caching hits here
        prompts.append(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Explain {topic}."}]
        )
    for n in (20, 60, 90):
        doc = long_document(rng, n)
        prompts.append([{"role": "user", "content": f"Summarise this log in two sentences:\n{doc}"}])
    prompts.append([{"role": "user", "content": f"{long_document(rng, 100)}\nWhat happened on day 42?"}])
    prompts.append(
        [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": "Nice to meet you, Ada!"},
            {"role": "user", "content": "What is my name, and what rhymes with it?"},
        ]
    )
    prompts.append([{"role": "user", "content": "Émojis 🎉 and accents: café, naïve, 東京. Repeat them."}])
    return prompts


@dataclass
class Reference:
    token_ids: list[int]
    top: list[list[int]]  # top-5 token ids at each step


@pytest.fixture(scope="module")
def model_path():  # type: ignore[no-untyped-def]
    return pull_default_model()


@pytest.fixture(scope="module")
def prompt_ids(model_path) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = [tokenizer.encode(text) for text in RAW_PROMPTS]
    for messages in chat_prompts():
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    lengths = sorted(len(i) for i in ids)
    assert len(ids) >= 16 and lengths[0] <= 8 and 1000 <= lengths[-1] <= 1500, lengths
    return ids


@pytest.fixture(scope="module")
def references(model_path, prompt_ids) -> list[Reference]:  # type: ignore[no-untyped-def]
    """Hugging Face greedy decoding with its own KV cache, never stopping at EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    # transformers 5.24 calls the KV cache `cache` (in and out); earlier 5.x `past_key_values`
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model(torch.tensor([ids]), use_cache=True)
            past, tokens, tops = out[name], [], []
            logits = out.logits[0, -1]
            for _ in range(NEW_TOKENS):
                tops.append(torch.topk(logits, TOP).indices.tolist())
                token = int(torch.argmax(logits))
                tokens.append(token)
                out = model(torch.tensor([[token]]), use_cache=True, **{name: past})
                past, logits = out[name], out.logits[0, -1]
            refs.append(Reference(tokens, tops))
    return refs


def run_engine(model_path, prompt_ids, *, together: bool, **config) -> tuple[list[Reference], Engine]:  # type: ignore[no-untyped-def]
    engine = Engine.from_config(EngineConfig(model=str(model_path), dtype="float32", **config))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    if together:
        completions = engine.generate(prompt_ids, params)
    else:
        completions = [engine.generate([ids], params)[0] for ids in prompt_ids]
    results = [Reference(c.token_ids, [[t for t, _ in lp.top] for lp in c.logprobs]) for c in completions]
    engine.scheduler.check_integrity()
    return results, engine


def assert_matches(ours: list[Reference], refs: list[Reference]) -> int:
    """Exact match, or a near-tie flip at the first divergence. Returns the number of flips."""
    flips = 0
    for i, (got, want) in enumerate(zip(ours, refs, strict=True)):
        assert len(got.token_ids) == NEW_TOKENS
        if got.token_ids == want.token_ids:
            continue
        step = next(s for s, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)) if a != b)
        ours_tok, ref_tok = got.token_ids[step], want.token_ids[step]
        assert ours_tok in want.top[step] and ref_tok in got.top[step], (
            f"prompt {i}: diverged at step {step}: ours {ours_tok}, HF {ref_tok}; "
            f"HF top-5 {want.top[step]}, ours {got.top[step]}"
        )
        flips += 1
    # A flip is a rare near-tie; many would mean a real bug hiding behind the tolerance.
    assert flips <= 2, f"{flips} of {len(refs)} prompts diverged"
    return flips


def test_each_prompt_alone(model_path, prompt_ids, references) -> None:  # type: ignore[no-untyped-def]
    ours, _ = run_engine(model_path, prompt_ids, together=False, enable_prefix_caching=False)
    assert_matches(ours, references)


def test_all_prompts_in_one_batch_with_prefix_caching(model_path, prompt_ids, references) -> None:  # type: ignore[no-untyped-def]
    # A small token budget forces chunked prefill mixed with decodes.
    ours, engine = run_engine(model_path, prompt_ids, together=True, max_num_batched_tokens=512)
    assert engine.kv_cache.num_prefix_hits > 0, "the shared system prompt should hit the prefix cache"
    assert_matches(ours, references)


def test_all_prompts_in_one_batch_without_prefix_caching(model_path, prompt_ids, references) -> None:  # type: ignore[no-untyped-def]
    ours, engine = run_engine(model_path, prompt_ids, together=True, enable_prefix_caching=False)
    assert engine.kv_cache.num_prefix_hits == 0
    assert_matches(ours, references)


def test_preemption_does_not_change_output(model_path, prompt_ids, references) -> None:  # type: ignore[no-untyped-def]
    longest = max(len(i) for i in prompt_ids) + NEW_TOKENS
    num_blocks = -(-longest // 16) + 12  # the longest fits alone, barely anything else does
    ours, engine = run_engine(model_path, prompt_ids, together=True, num_kv_blocks=num_blocks)
    assert engine.scheduler.num_preemptions > 0
    assert_matches(ours, references)


def test_tiered_policies_preempting_and_evicting_do_not_change_output(
    model_path, prompt_ids, references
) -> None:  # type: ignore[no-untyped-def]
    """The tier-aware policy set, with a step budget that holds back the batch tier and a cache small
    enough to force preemption by recompute and eviction of cached blocks: greedy output unchanged."""
    longest = max(len(i) for i in prompt_ids) + NEW_TOKENS
    num_blocks = -(-longest // 16) + 12
    policies = WorkerPolicies.tiered()
    engine = Engine.from_config(
        EngineConfig(model=str(model_path), dtype="float32", num_kv_blocks=num_blocks), policies
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    # A TPOT target about one float32 step here: steps are capped near two decode steps (the
    # budget's floor), so batch decodes sit steps out, while the cache still fills enough to preempt.
    tiers = [TierRef("interactive", 0, ttft_ms=1000.0, tpot_ms=20.0), TierRef("batch", 2)]
    ids = [engine.add_request(p, params, tier=tiers[i % 2]) for i, p in enumerate(prompt_ids)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    top: dict[str, list[list[int]]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
            top[output.request_id] += [[t for t, _ in lp.top] for lp in output.logprobs]
    engine.scheduler.check_integrity()
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.pool.num_evictions > 0
    assert_matches([Reference(tokens[i], top[i]) for i in ids], references)
