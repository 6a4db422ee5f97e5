"""In-process engine benchmark: our engine vs Hugging Face generate, and the bandwidth roofline.

    python -m loadtest.engine_bench --json

One run measures, on this machine with the same dtype and thread count for both sides:
  (a) a mixed workload (seeded: prompts 20–1,000 tokens, outputs 16–256 tokens) through our engine
      and through `transformers` generate in static, left-padded batches of 8 (a static batcher);
  (b) single-stream decode of one request on each;
  (c) the memory-bandwidth roofline for batch-1 decode: measured copy bandwidth (bytes copied/s) ÷
      weight bytes, and the stricter one from a read-only reduction's bandwidth (bytes read/s).
Throughput counts only requested output tokens (a static batcher's padding is not useful work).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loadtest.machine_state import pass_time, read_gb_s
from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.cpu_isa import probe
from worker.engine import Engine
from worker.model_runner import ModelRunner
from worker.models.cpu_linear import DecodeLinear, PanelLinear
from worker.models.cpu_packing import PackedLinear
from worker.models.store import resolve_model


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(
    num_requests: int,
    vocab_size: int,
    seed: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
) -> Workload:
    rng = random.Random(seed)
    # Ids from the ordinary part of the vocabulary (skip the special tokens at the start).
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_range))]
        for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


def progress(message: str) -> None:
    print(f"[engine_bench] {message}", file=sys.stderr, flush=True)


def run_engine(engine: Engine, workload: Workload) -> float:
    """Output tokens per second for the whole workload submitted at once."""
    for ids, n in zip(workload.prompts, workload.output_lens, strict=True):
        engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    assert produced == sum(workload.output_lens), (produced, sum(workload.output_lens))
    return produced / elapsed


def run_hf_static(model: Any, workload: Workload, batch_size: int, pad_id: int) -> float:
    """A static batcher: left-padded batches of ``batch_size``, each run to its longest output."""
    start = time.perf_counter()
    useful = 0
    order = list(range(len(workload.prompts)))
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        width = max(len(workload.prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for row, i in enumerate(batch):
            prompt = workload.prompts[i]
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        max_new = max(workload.output_lens[i] for i in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        assert out.shape[1] == width + max_new
        useful += sum(workload.output_lens[i] for i in batch)
        progress(f"hf static batch {b // batch_size + 1}/{-(-len(order) // batch_size)} done")
    return useful / (time.perf_counter() - start)


def single_stream(
    engine: Engine, hf_model: Any, prompt: list[int], num_tokens: int, pad_id: int
) -> tuple[float, float]:
    ours = engine_single_stream(engine, prompt, num_tokens)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf_model.generate(
            input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=pad_id
        )
        start = time.perf_counter()
        hf_model.generate(
            input_ids=ids,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return ours, num_tokens / (time.perf_counter() - start)


def engine_single_stream(engine: Engine, prompt: list[int], num_tokens: int) -> float:
    """Tokens/s of one request end to end, after a warm-up (which also caches the prompt's blocks)."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    engine.generate([prompt], params)
    return num_tokens / (time.perf_counter() - start)


def cpu_kernels_ratio(
    path: Path, dtype: str, engine: Engine, prompt: list[int], num_tokens: int
) -> dict[str, float]:
    """Single stream with our C kernels vs the same engine on torch's matmuls, alternated three times
    (this VM's memory bandwidth drifts within a minute), each side's best run counted."""
    base = Engine.from_config(EngineConfig(model=str(path), dtype=dtype, kv_cache_gb=0.5, cpu_kernels=False))
    ours, theirs = [], []
    for round_ in range(3):
        ours.append(engine_single_stream(engine, prompt, num_tokens))
        theirs.append(engine_single_stream(base, prompt, num_tokens))
        progress(
            f"cpu kernels round {round_ + 1}/3: {ours[-1]:.1f} vs {theirs[-1]:.1f} tok/s (torch matmuls)"
        )
    return {
        "cpu_kernels_single_tok_s": round(max(ours), 2),
        "torch_matmuls_single_tok_s": round(max(theirs), 2),
        "cpu_kernels_single_ratio": round(max(ours) / max(theirs), 3),
    }


def copy_bandwidth_gb_s(num_bytes: int = 512 * 1024**2, repeats: int = 5) -> float:
    """Memory bandwidth as a plain copy measures it: bytes copied per second (memcpy convention)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return num_bytes / pass_time(lambda: dst.copy_(src), repeats) / 1e9


def read_bandwidth_gb_s(num_bytes: int = 512 * 1024**2, repeats: int = 5) -> float:
    """Read-only bandwidth: bytes summed per second (a reduction reads and writes almost nothing), the
    best of ``repeats``."""
    return read_gb_s(num_bytes, repeats, min)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step must read: every linear weight (packed or not) and the logits
    matrix once; of the embedding table only one row, unless it doubles as the lm_head."""
    total = 0
    for module in model.modules():
        if isinstance(module, PackedLinear | PanelLinear):
            total += module.weight_bytes
            continue
        is_logits_matrix = isinstance(module, torch.nn.Embedding) and getattr(model, "lm_head", None) is None
        if isinstance(module, torch.nn.Linear | DecodeLinear) or is_logits_matrix:
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            total += weight.numel() * weight.element_size()
    return total


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="auto: what the engine picks"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(20, 1000))
    parser.add_argument("--output-range", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print only the JSON object on stdout")
    parser.add_argument(
        "--cpu-kernels-baseline",
        action="store_true",
        help="also single-stream the engine without our C kernels (torch's matmuls), alternating",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, object]:
    """Measure; the JSON object ``main`` prints."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    path: Path = resolve_model(args.model)
    engine = Engine.from_config(EngineConfig(model=str(path), dtype=args.dtype, kv_cache_gb=2.0))
    dtype = engine.config.dtype  # "auto" resolved for this CPU; Hugging Face runs the same
    progress(f"model {path}, dtype {dtype}, {args.threads} threads, cpu {probe().describe()}")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    vocab = engine.model_config.vocab_size
    pad_id = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
    workload = make_workload(
        args.num_requests, vocab, args.seed, tuple(args.prompt_range), tuple(args.output_range)
    )

    bandwidth = copy_bandwidth_gb_s()
    read_bandwidth = read_bandwidth_gb_s()
    progress(f"copy bandwidth {bandwidth:.1f} GB/s, read bandwidth {read_bandwidth:.1f} GB/s")
    prompt = workload.prompts[0][:32]
    engine_single, hf_single = single_stream(engine, hf, prompt, args.single_tokens, pad_id)
    progress(f"single stream: engine {engine_single:.1f} tok/s, hf {hf_single:.1f} tok/s")
    engine_tok_s = run_engine(engine, workload)
    progress(f"engine workload: {engine_tok_s:.1f} tok/s")
    hf_tok_s = run_hf_static(hf, workload, args.hf_batch_size, pad_id)
    progress(f"hf static workload: {hf_tok_s:.1f} tok/s")

    assert isinstance(engine.runner, ModelRunner)
    num_weight_bytes = weight_bytes(engine.runner.model)
    roofline = bandwidth * 1e9 / num_weight_bytes
    read_roofline = read_bandwidth * 1e9 / num_weight_bytes
    result = {
        "model": path.name,
        "dtype": dtype,
        "cpu": probe().describe(),
        "threads": args.threads,
        "num_requests": args.num_requests,
        "total_output_tokens": sum(workload.output_lens),
        "engine_tok_s": round(engine_tok_s, 2),
        "hf_static_tok_s": round(hf_tok_s, 2),
        "hf_static_batch_size": args.hf_batch_size,
        "throughput_ratio": round(engine_tok_s / hf_tok_s, 3),
        "engine_single_tok_s": round(engine_single, 2),
        "hf_single_tok_s": round(hf_single, 2),
        "single_ratio": round(engine_single / hf_single, 3),
        "bandwidth_gb_s": round(bandwidth, 2),
        "weight_bytes": num_weight_bytes,
        "roofline_single_tok_s": round(roofline, 2),
        "roofline_fraction": round(engine_single / roofline, 3),
        # The stricter bound: decode only reads weights, and a read-only stream outruns a copy.
        "read_bandwidth_gb_s": round(read_bandwidth, 2),
        "read_roofline_single_tok_s": round(read_roofline, 2),
        "read_roofline_fraction": round(engine_single / read_roofline, 3),
    }
    if args.cpu_kernels_baseline:
        result |= cpu_kernels_ratio(path, dtype, engine, prompt, args.single_tokens)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
