"""The whole engine (scheduler, paged cache, prefix cache, the step path this CPU's probe chooses) on a
tiny random-weight Llama, greedy token for token against Hugging Face in float32.

SmolLM2's attention shape (head_dim 64, three query heads to a KV head) at a size that runs in seconds,
and in minutes under an emulated CPU (tests/worker/test_emulated_cpu.py runs it there): the fused C
layer on AVX2 and AVX-512 CPUs, the torch path below AVX2. test_engine_smollm2 is the real model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.cpu_isa import IsaLevel, probe
from worker.engine import Engine

pytestmark = pytest.mark.isa

NEW_TOKENS = 12
TOP = 5


def hf_greedy(folder: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[list[int]]]]:
    """(tokens, top-5 at each step) of each prompt, Hugging Face's own forward and KV cache."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            tokens, tops = list(ids), []
            for _ in range(NEW_TOKENS):
                logits = model(torch.tensor([tokens])).logits[0, -1]
                tops.append(torch.topk(logits, TOP).indices.tolist())
                tokens.append(int(torch.argmax(logits)))
            out.append((tokens[len(ids) :], tops))
    return out


def test_greedy_output_equals_hugging_face_on_the_path_the_probe_chose(tiny_model: Path) -> None:
    rng = random.Random(7)
    vocab = len(json.loads((tiny_model / "tokenizer.json").read_text())["model"]["vocab"])
    shared = [rng.randrange(3, vocab) for _ in range(20)]  # two prompts share a prefix: cache hits
    prompts = [
        [rng.randrange(3, vocab) for _ in range(5)],
        shared + [rng.randrange(3, vocab) for _ in range(9)],
        shared + [rng.randrange(3, vocab) for _ in range(17)],
        [rng.randrange(3, vocab) for _ in range(70)],
    ]
    engine = Engine.from_config(
        EngineConfig(model=str(tiny_model), dtype="float32", num_kv_blocks=64, max_model_len=256)
    )
    caps = probe()
    step = engine.runner.decode_step
    fused = getattr(getattr(step, "kernel", None), "isa", None)
    assert fused == {IsaLevel.AVX2: "avx2", IsaLevel.DEFAULT: None}.get(caps.level, "avx512"), caps.describe()

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    alone = [engine.generate([ids], params)[0] for ids in prompts]
    together = engine.generate(prompts, params)  # batched, the shared prefix cached
    assert together[2].num_cached_tokens >= 16
    engine.scheduler.check_integrity()
    flips = 0
    for i, (want, want_top) in enumerate(hf_greedy(tiny_model, prompts)):
        for got in (alone[i], together[i]):
            if got.token_ids == want:
                continue
            # float32 sums in another order may flip a near-tie: then both sides' tokens are in the
            # other's top-5 at the first divergence, and nothing after it is comparable
            at = next(s for s, (a, b) in enumerate(zip(got.token_ids, want, strict=True)) if a != b)
            got_top = [t for t, _ in got.logprobs[at].top]
            assert got.token_ids[at] in want_top[at] and want[at] in got_top, (
                f"prompt {i} diverged at step {at} on {caps.describe()}: ours {got.token_ids}, HF {want}"
            )
            flips += 1
    assert flips <= 1, f"{flips} near-tie flips in {2 * len(prompts)} sequences"
