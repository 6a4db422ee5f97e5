"""``tierserve bench tp``: tensor parallelism on CPU gives the tokens one process gives.

    tierserve bench tp --json [--record]

For each model, the same prompts, greedy: one engine in this process (tp=1), then ``size`` processes
over gloo on 127.0.0.1 (rank 0 an engine on its shard with the default tiered policies, the others
following the steps it sends: ``worker/tp_step.py``). Both on the torch path (the fused C layer does
not take a shard), float32, one thread a process. Models: tiny random-weight GQA Llama (4 query heads,
2 K/V heads: split) and Qwen2 (1 K/V head: replicated) at tp=2, and the embedded model (SmolLM2-135M's
float folder from ``models pull``; its 9 query heads divide by 3, not 2) at tp=3. On a 2-core machine
the speeds only show what the all-reduces cost; equality is the point: ``tp_equal``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from loadtest.launch import free_port
from loadtest.record import machine
from wire.byte_tokenizer import ByteTokenizer
from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import Engine
from worker.model_runner import build_model_runner
from worker.models.store import ModelNotFoundError, resolve_model
from worker.policy_set import WorkerPolicies
from worker.tp_step import TensorParallelRunner, follow

TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)
TINY_MODELS = {
    "tiny-llama-gqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)),
    "tiny-qwen2-one-kv-head": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**{**TINY, "num_key_value_heads": 1})
    ),
}


def progress(message: str) -> None:
    print(f"[bench tp] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench tp", description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens a prompt")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--no-embedded", action="store_true", help="the tiny models only")
    return parser.parse_args(argv)


def prompts(num: int, vocab_size: int) -> list[list[int]]:
    """Fixed prompts of different lengths (so steps mix prefill chunks and decodes)."""
    return [[3 + (i * 37 + j * 11) % (vocab_size - 3) for j in range(4 + 9 * i)] for i in range(num)]


def _config(path: Path, size: int = 1, rank: int = 0) -> EngineConfig:
    return EngineConfig(
        model=str(path), dtype="float32", device="cpu", kv_cache_gb=0.25, num_threads=1,
        cpu_kernels=False, tensor_parallel_size=size, tensor_parallel_rank=rank,
    )  # fmt: skip


def _engine(path: Path, size: int = 1, rank: int = 0) -> Engine:
    config = _config(path, size, rank)
    if (path / "tokenizer.json").is_file():  # the embedded model: its own tokenizer
        return Engine.from_config(config, WorkerPolicies.tiered())
    runner, model_config, num_blocks = build_model_runner(config, path)
    return Engine(config, ByteTokenizer(), runner, model_config, num_blocks, WorkerPolicies.tiered())


def _generate(
    engine: Engine, batch: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    tokens = [c.token_ids for c in engine.generate(batch, params)]
    return tokens, sum(map(len, tokens)) / (time.perf_counter() - start)


def _rank(rank: int, size: int, address: str, path: Path, batch: list[list[int]], params: SamplingParams,
          results: Any) -> None:  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size)
    try:
        if rank == 0:
            engine = _engine(path, size, rank)
            _generate(engine, batch[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
            results["tokens"], results["tok_s"] = _generate(engine, batch, params)
            assert isinstance(engine.runner, TensorParallelRunner)
            engine.runner.close()
            results["steps"] = engine.runner.num_steps_sent
        else:
            runner, _, _ = build_model_runner(_config(path, size, rank), path)
            results[f"followed {rank}"] = follow(runner)
    finally:
        dist.destroy_process_group()


def measure(
    name: str, path: Path, size: int, batch: list[list[int]], params: SamplingParams
) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tp=1 on one thread, as each rank runs: the caller's count is restored
    try:
        engine = _engine(path)
        _generate(engine, batch[:1], SamplingParams(max_tokens=2, temperature=0.0))
        alone, tok_s_1 = _generate(engine, batch, params)
        del engine
    finally:
        torch.set_num_threads(threads)
    progress(f"{name}: tp=1 {tok_s_1:.1f} tok/s; tp={size} over gloo ...")
    with mp.Manager() as manager:
        results = manager.dict()
        address = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(_rank, args=(size, address, path, batch, params, results), nprocs=size, join=True)
        sharded = dict(results)
    equal = sharded["tokens"] == alone
    followed = [sharded[f"followed {r}"] for r in range(1, size)]
    progress(f"{name}: tp={size} {sharded['tok_s']:.1f} tok/s, tokens equal: {equal}")
    return {
        "model": name,
        "tensor_parallel_size": size,
        "tp_equal": equal,
        "tok_s_tp1": round(tok_s_1, 2),
        f"tok_s_tp{size}": round(float(sharded["tok_s"]), 2),
        "output_tokens": sum(map(len, alone)),
        "steps_sent": sharded["steps"],
        "steps_followed": followed,
    }


def run(args: argparse.Namespace) -> dict[str, object]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tierserve-bench-tp-") as tmp:
        for name, build in TINY_MODELS.items():
            torch.manual_seed(0)
            folder = Path(tmp) / name
            build().save_pretrained(folder)
            rows.append(measure(name, folder, 2, prompts(args.num_prompts, TINY["vocab_size"]), params))
    embedded: str | None = None
    if not args.no_embedded:
        try:
            folder = resolve_model("default")
        except ModelNotFoundError as exc:
            embedded = f"skipped: {exc}"
        else:
            batch = prompts(args.num_prompts, 49152)
            rows.append(measure("smollm2-135m-instruct (float32)", folder, 3, batch, params))
    tiny = [r for r in rows if r["tensor_parallel_size"] == 2]
    return {
        "scenario": "tp",
        "cpu": machine(),
        "backend": "gloo, one process a rank, 1 thread each, float32, the torch path",
        "tensor_parallel_size": 2,
        "tp_equal": all(r["tp_equal"] for r in rows),
        "tok_s_tp1": tiny[0]["tok_s_tp1"],
        "tok_s_tp2": tiny[0]["tok_s_tp2"],
        "models": rows,
        **({"embedded": embedded} if embedded else {}),
    }
