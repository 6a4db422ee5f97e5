"""The ``sampler`` scenario: the sampler's row operations in C against their torch references, in one run.

    tierserve bench sampler --json [--record] [--rows 32] [--repeats 30]

One engine in-process (the embedded model, the default dtype) runs ``--rows`` chat prompts together,
sampling at temperature 1, and keeps the logits of its decode steps: real next-token distributions
(a small model's, at temperature 1: flat ones, where top-p keeps hundreds to thousands of tokens).
Then one ``[rows, vocab]`` batch of them goes through ``Sampler`` under each configuration below, with
the torch references (``kernels/sampling.py``: ``max`` for the argmax, a sort of every row for the
top-k / top-p cut) and with the C kernels (``kernels/cpu/sampling.c``, the runner's on CPU), the two
alternated, ``--repeats`` calls each: the median call in ms and their ratio (reference / C, above 1
the kernels are faster). ``same_tokens``: both drew the same tokens for the same seeds. For scale,
``decode_step_ms`` is the engine's median decode step at that batch (sampling at temperature 1 with
the kernels included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from loadtest.figures import rounded
from loadtest.record import machine
from wire.sampling import SamplingParams

CONFIGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature_1": {"temperature": 1.0},
    "temperature_0.7_top_p_0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature_1_top_p_0.95": {"temperature": 1.0, "top_p": 0.95},
    "top_k_50": {"temperature": 1.0, "top_k": 50},
    "top_k_50_top_p_0.9_min_p_0.05": {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
}
PROMPTS = (
    "Tell me a long story about a lighthouse keeper.",
    "Describe the water cycle in detail.",
    "Explain how a bicycle gear works, step by step.",
    "Write about the history of the printing press.",
    "What should I pack for a week of hiking?",
    "Invent a recipe with apples and cheese.",
)


def progress(message: str) -> None:
    print(f"[sampler] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench sampler", description=__doc__)
    parser.add_argument("--rows", type=int, default=32, help="rows a sampler call (the decode batch)")
    parser.add_argument("--tokens", type=int, default=24, help="decode steps whose logits are kept")
    parser.add_argument("--repeats", type=int, default=30, help="calls of each sampler a configuration")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.tokens < 2 or args.repeats < 1:
        parser.error("--rows and --repeats must be at least 1, --tokens at least 2")
    return args


def run(args: argparse.Namespace) -> dict[str, object]:
    from kernels.sampling import TORCH_SAMPLING
    from worker.config import EngineConfig
    from worker.engine import Engine
    from worker.model_runner import ModelRunner
    from worker.sampler import Sampler, SamplingRow, make_generator

    engine = Engine.from_config(EngineConfig())
    kernels = engine.runner.sampling
    if not isinstance(engine.runner, ModelRunner) or kernels is TORCH_SAMPLING:
        raise SystemExit("sampler bench: the engine has no C sampling kernels (a CPU with a C compiler)")
    logits, step_ms = _decode_logits(engine, args.rows, args.tokens)
    progress(f"{logits.shape[0]} x {logits.shape[1]} logits; decode step {step_ms:.1f} ms")
    figures: dict[str, object] = {}
    same = True
    for name, options in CONFIGS.items():
        times: dict[str, list[float]] = {"reference": [], "kernels": []}
        tokens: dict[str, list[int]] = {}
        for i in range(args.repeats + 1):  # the first of each: a warm-up, not timed
            for label, ops in (("reference", TORCH_SAMPLING), ("kernels", kernels)):
                params = SamplingParams(**options)
                rows = [SamplingRow(params, [], [], make_generator(i * 1000 + r)) for r in range(len(logits))]
                start = time.perf_counter()
                drawn = Sampler(ops)(logits, rows).token_ids
                if i:
                    times[label].append((time.perf_counter() - start) * 1e3)
                tokens[label] = drawn
            same = same and tokens["reference"] == tokens["kernels"]
        reference, c = statistics.median(times["reference"]), statistics.median(times["kernels"])
        figures[name] = {
            "reference_ms": rounded(reference),
            "kernels_ms": rounded(c),
            "ratio": rounded(reference / c),
        }
        progress(f"{name}: torch {reference:.2f} ms, C {c:.2f} ms")
    return {
        "scenario": "sampler",
        "model": "smollm2-135m-instruct",
        "weights": "the default (its Q4_1 GGUF), dtype auto",
        "cpu": machine(),
        "rows": logits.shape[0],
        "vocab": logits.shape[1],
        "decode_step_ms": rounded(step_ms),
        "configs": figures,
        "same_tokens": same,
    }


def _decode_logits(engine: Any, num_rows: int, tokens: int) -> tuple[Any, float]:
    """The last decode step's logits of ``num_rows`` prompts sampled together at temperature 1 for
    ``tokens`` steps, and the median decode step's time."""
    import torch

    from worker.sampler import Sampler

    kept: list[torch.Tensor] = []

    class Keeping(Sampler):
        def __call__(self, logits: torch.Tensor, rows: Any) -> Any:
            if logits.shape[0] == num_rows:
                kept[:] = [logits.clone()]
            return super().__call__(logits, rows)

    engine.sampler = Keeping(engine.runner.sampling)
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True)
    for i in range(num_rows):
        prompt = PROMPTS[i % len(PROMPTS)]
        engine.add_request(engine.apply_chat_template([{"role": "user", "content": prompt}]), params)
    steps: list[float] = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - start) * 1e3)
    engine.sampler = Sampler(engine.runner.sampling)
    if not kept:
        raise SystemExit(f"sampler bench: no step sampled {num_rows} rows together")
    return kept[0], statistics.median(steps[-(tokens // 2) :])
