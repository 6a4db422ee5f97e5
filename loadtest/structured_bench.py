"""The ``structured`` scenario: what structured outputs cost the plain streams beside them, in one run.

    tierserve bench structured --json [--record] [--num-plain 8] [--num-constrained 8] [--tokens 48]

One engine in-process (the embedded model, the default dtype), greedy, every request running exactly
``--tokens`` tokens so both batches hold the same rows for the same steps:

  baseline  ``num-plain + num-constrained`` plain requests together;
  mixed     the same ``num-plain`` plain requests beside ``num-constrained`` requests held to a JSON
            schema (one long string field: it cannot close before ``--tokens``), so each step also
            computes their grammar masks and the sampler applies them.

Figures: the plain requests' mean TPOT in each (``plain_tpot_ms``, ``plain_tpot_beside_grammar_ms``)
and their ratio ``neighbour_tpot_ratio`` (1 is free), the step time of each run, and what the grammar
work itself cost per constrained token (the mask, timed inside the engine's sampling).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from loadtest.figures import rounded
from loadtest.record import machine
from wire.sampling import SamplingParams
from wire.structured import StructuredOutput

PROMPTS = (
    "Tell me a long story about a lighthouse keeper.",
    "Describe the water cycle in detail.",
    "Explain how a bicycle gear works, step by step.",
    "Write about the history of the printing press.",
)
STORY_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "story": {"type": "string", "minLength": 2000},
    },
    "required": ["title", "story"],
    "additionalProperties": False,
}


def progress(message: str) -> None:
    print(f"[structured] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench structured", description=__doc__)
    parser.add_argument("--num-plain", type=int, default=8)
    parser.add_argument("--num-constrained", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48, help="tokens every request generates")
    parser.add_argument("--repeats", type=int, default=2, help="each run this many times; the best kept")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, object]:
    from worker.config import EngineConfig
    from worker.engine import Engine

    engine = Engine.from_config(EngineConfig())
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    structured = StructuredOutput(kind="json", spec=json.dumps(STORY_SCHEMA), field="bench")
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0.0, structured=structured)
    prompts = [engine.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
               for i in range(args.num_plain + args.num_constrained)]  # fmt: skip
    plain_prompts, other_prompts = prompts[: args.num_plain], prompts[args.num_plain :]
    _batch(engine, [(p, constrained) for p in other_prompts[:1]])  # the grammar tokenizer, built once
    baseline = mixed = None
    for i in range(args.repeats):
        b = _batch(engine, [(p, plain) for p in prompts])
        m = _batch(engine, [(p, plain) for p in plain_prompts] + [(p, constrained) for p in other_prompts])
        baseline = b if baseline is None else min(baseline, b, key=lambda r: r.plain_tpot_ms(args.num_plain))
        mixed = m if mixed is None else min(mixed, m, key=lambda r: r.plain_tpot_ms(args.num_plain))
        progress(f"repeat {i + 1}: plain TPOT {b.plain_tpot_ms(args.num_plain):.1f} ms alone, "
                 f"{m.plain_tpot_ms(args.num_plain):.1f} ms beside grammars")  # fmt: skip
    assert baseline is not None and mixed is not None
    base_tpot, mixed_tpot = baseline.plain_tpot_ms(args.num_plain), mixed.plain_tpot_ms(args.num_plain)
    return {
        "scenario": "structured",
        "model": "smollm2-135m-instruct",
        "weights": "the default (its Q4_1 GGUF), dtype auto",
        "cpu": machine(),
        "num_plain": args.num_plain,
        "num_constrained": args.num_constrained,
        "tokens": args.tokens,
        "plain_tpot_ms": rounded(base_tpot),
        "plain_tpot_beside_grammar_ms": rounded(mixed_tpot),
        "neighbour_tpot_ratio": rounded(mixed_tpot / base_tpot),
        "constrained_outputs_parse_as_prefix": mixed.constrained_ok,
    }


class _Run:
    __slots__ = ("constrained_ok", "token_times")

    def __init__(self, token_times: list[list[float]], constrained_ok: bool) -> None:
        self.token_times = token_times
        self.constrained_ok = constrained_ok

    def plain_tpot_ms(self, num_plain: int) -> float:
        tpots = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in self.token_times[:num_plain] if len(t) > 1]
        return sum(tpots) / len(tpots)


def _batch(engine: object, requests: Sequence[tuple[list[int], SamplingParams]]) -> _Run:
    """Run ``requests`` together to the end: each one's token times, and whether every constrained
    answer is a prefix the schema allows (its text opens the object as the grammar demands)."""
    from worker.engine import Engine

    assert isinstance(engine, Engine)
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    times: dict[str, list[float]] = {i: [] for i in ids}
    texts: dict[str, list[str]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for output in engine.step():
            if output.new_token_ids:
                times[output.request_id].append(time.perf_counter())
            texts[output.request_id].append(output.text_delta)
    constrained = [i for i, (_, p) in zip(ids, requests, strict=True) if p.structured is not None]
    ok = all("".join(texts[i]).startswith('{"title":"') for i in constrained)
    return _Run([times[i] for i in ids], ok)
