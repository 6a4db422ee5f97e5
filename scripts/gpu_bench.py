"""The GPU figures of issue 8 in one run, printed as JSON (``scripts/gpu_check.sh`` calls it).

    python scripts/gpu_bench.py --out bench.json      # on one CUDA GPU, a few minutes, nothing downloaded
    python scripts/gpu_bench.py --dry-run             # CPU, tiny shapes: exercises every section's code

Models are built from configs with random weights (speed does not depend on the values):
  * SmolLM2-135M's shape: Hugging Face equivalence in bf16 (greedy, tolerant at the first divergence),
    and decode tokens/s of our engine (eager and with CUDA graphs) vs ``transformers`` generate at
    batch 1, 32 and 128;
  * the decode attention kernel at batch 64 x 4k context (Llama-3-8B's attention shape): bytes of K/V
    read per second vs a measured device-to-device copy;
  * Llama-3-8B's shape at batch 1 with CUDA graphs: fraction of the weight-bandwidth roofline.
Decode tokens/s is measured as the difference of two runs (few and many new tokens), so prefill and
start-up cancel out. In ``--dry-run`` every figure is meaningless (tiny shapes, CPU) and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOLLM2: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LLAMA3_8B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
    tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
TINY: dict[str, Any] = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


class IdTokenizer:
    """Prompts are token ids; output text is the ids (random weights produce any id of the vocab)."""

    eos_token_id = None

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return "".join(f" {i}" for i in ids)


def log(message: str) -> None:
    print(f"[gpu_bench] {message}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device, repeats: int = 1) -> float:
    """Best wall time of ``repeats`` runs (after the first, which warms up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (num, length), generator=gen).tolist()


def save_hf_model(shape: dict[str, Any], path: Path, dtype: torch.dtype, seed: int = 0) -> Any:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**shape, initializer_range=0.1)  # logits of order 1, few near-ties
    model: Any = transformers.LlamaForCausalLM(config)
    model = model.to(dtype)
    model.save_pretrained(path)
    return model.eval()


def build_engine(
    path: Path, device: torch.device, dtype: str, max_num_seqs: int, graphs: bool, **kw: Any
) -> Any:
    """Our engine over ``path`` on the Triton kernels (``kernel_backend`` in ``kw`` chooses another)."""
    from worker.config import EngineConfig
    from worker.engine import Engine
    from worker.model_runner import build_model_runner

    config = EngineConfig(
        model=str(path), dtype=dtype, device=str(device), max_num_seqs=max_num_seqs, cuda_graphs=graphs,
        max_num_batched_tokens=max(2048, max_num_seqs * 160), **{"kernel_backend": "triton", **kw},
    )  # fmt: skip
    runner, model_config, num_blocks = build_model_runner(config, path)
    return Engine(config, IdTokenizer(), runner, model_config, num_blocks)


def engine_tokens_per_s(
    engine: Any, prompts: list[list[int]], short: int, long: int, device: torch.device
) -> float:
    from wire.sampling import SamplingParams

    def run(n: int) -> Callable[[], Any]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return lambda: engine.generate(prompts, params)

    t_short, t_long = timed(run(short), device), timed(run(long), device)
    return len(prompts) * (long - short) / max(t_long - t_short, 1e-9)


def hf_tokens_per_s(
    model: Any, prompts: list[list[int]], short: int, long: int, device: torch.device
) -> float:
    ids = torch.tensor(prompts, device=device)

    def run(n: int) -> Callable[[], Any]:
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kw)

    with torch.inference_mode():
        t_short, t_long = timed(run(short), device), timed(run(long), device)
    return len(prompts) * (long - short) / max(t_long - t_short, 1e-9)


def hf_equivalence(
    hf_model: Any, engine: Any, prompts: list[list[int]], new: int, device: torch.device
) -> dict:
    """Greedy tokens, ours vs HF, per prompt: identical, or at the first divergence each side's token is
    in the other side's top 5 (everything after a divergence is incomparable)."""
    from wire.sampling import SamplingParams

    ours = engine.generate(
        prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=5)
    )
    results = []
    for prompt, done in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        theirs = out.sequences[0, len(prompt) :].tolist()
        first = next((i for i, (a, b) in enumerate(zip(done.token_ids, theirs, strict=True)) if a != b), None)
        ok = True
        if first is not None:
            hf_top = out.scores[first][0].topk(5).indices.tolist()
            our_top = [t for t, _ in done.logprobs[first].top]
            ok = done.token_ids[first] in hf_top and theirs[first] in our_top
        results.append({"prompt_len": len(prompt), "first_divergence": first, "ok": ok})
    return {"passed": all(r["ok"] for r in results), "new_tokens": new, "prompts": results}


def copy_bandwidth(device: torch.device, numel: int) -> dict:
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, repeats=10)
    size = numel * 2
    read_t = timed(lambda: src.sum(), device, repeats=10)
    return {"bytes": size, "copy_seconds": t, "copy_read_plus_write_bytes_per_s": 2 * size / t,
            "copy_bytes_copied_per_s": size / t, "read_only_sum_bytes_per_s": size / read_t}  # fmt: skip


def attention_bandwidth(device: torch.device, num_seqs: int, context: int, copy: dict) -> dict:
    import kernels.triton_ops as tk
    from kernels.triton_ops.decode_attention import decode_bytes_read

    num_kv_heads, group, head_dim, block_size = 8, 4, 128, 16
    blocks_per_seq = context // block_size
    num_blocks = num_seqs * blocks_per_seq
    cache = torch.empty(
        2, num_kv_heads, num_blocks, block_size, head_dim, dtype=torch.bfloat16, device=device
    )
    cache.normal_()
    tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq)  # scattered blocks
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int64, device=device)
    query = torch.randn(num_seqs, num_kv_heads * group, head_dim, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(query)

    def run() -> None:
        tk.paged_decode_attention(
            query, cache, tables, seq_lens, head_dim**-0.5, max_seq_len=context, out=out
        )

    t = timed(run, device, repeats=20)
    read = decode_bytes_read(num_seqs, context, cache)
    bandwidth = read / t
    return {"batch": num_seqs, "context": context, "kv_bytes_read": read, "seconds": t,
            "kv_bytes_read_per_s": bandwidth,
            "fraction_of_copy_read_plus_write": bandwidth / copy["copy_read_plus_write_bytes_per_s"],
            "fraction_of_copy_bytes_copied": bandwidth / copy["copy_bytes_copied_per_s"]}  # fmt: skip


def roofline_8b(device: torch.device, shape: dict[str, Any], copy: dict, graphs: bool, steps: int) -> dict:
    """Our engine at batch 1 on a random-weight model built on the device (no checkpoint written)."""
    import json as _json

    from kernels.triton_ops.layer_ops import TritonLayerOps
    from worker.attention import KernelBackend, TritonPagedAttention, allocate_kv_cache
    from worker.config import EngineConfig
    from worker.decode_graphs import DecodeGraphs
    from worker.engine import Engine
    from worker.model_runner import ModelRunner
    from worker.models.config import load_model_config
    from worker.models.llama import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(_json.dumps({**shape, "architectures": ["LlamaForCausalLM"]}))
        config = load_model_config(Path(tmp))
    attention = TritonPagedAttention()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config, attention, TritonLayerOps()).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default_dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed" not in n)
    block_size, max_len = 16, 1024
    kv = allocate_kv_cache(config.num_layers, 128, block_size, config.num_kv_heads, config.head_dim,
                           torch.bfloat16, device)  # fmt: skip
    graph_set = None
    if graphs:
        graph_set = DecodeGraphs(model, kv, block_size, max_len, [1], device)
        graph_set.capture()
    runner = ModelRunner(model, kv, block_size, device, KernelBackend.TRITON, graph_set)
    engine_config = EngineConfig(model="random", device=str(device), num_kv_blocks=128, max_num_seqs=1,
                                 kernel_backend="triton", max_model_len=max_len)  # fmt: skip
    engine = Engine(engine_config, IdTokenizer(), runner, config, 128)
    prompts = random_prompts(1, 64, config.vocab_size, seed=3)
    tokens_per_s = engine_tokens_per_s(engine, prompts, 8, 8 + steps, device)
    step_s = 1 / tokens_per_s
    floor_copy = weight_bytes / copy["copy_read_plus_write_bytes_per_s"]
    floor_read = weight_bytes / copy["read_only_sum_bytes_per_s"]
    return {"weight_bytes_read_per_step": weight_bytes, "cuda_graphs": graphs, "decode_step_seconds": step_s,
            "tokens_per_s": tokens_per_s, "fraction_of_roofline_copy_bandwidth": floor_copy / step_s,
            "fraction_of_roofline_read_bandwidth": floor_read / step_s}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--skip-8b", action="store_true")
    args = parser.parse_args()
    dry = args.dry_run
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run, or on a GPU")
    device = torch.device("cpu" if dry else "cuda")
    shape = TINY if dry else SMOLLM2
    batches = [1, 2] if dry else [1, 32, 128]
    short, long = (1, 3) if dry else (16, 144)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": "cpu (dry run: tiny shapes, every figure meaningless)"
        if dry
        else torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        dtype = "float32" if dry else "bfloat16"
        hf_model = save_hf_model(shape, path, torch.float32 if dry else torch.bfloat16).to(device)
        engines = {False: build_engine(path, device, dtype, max(batches), graphs=False, max_model_len=512)}
        if not dry:
            engines[True] = build_engine(path, device, dtype, max(batches), graphs=True, max_model_len=512)
        log(f"models ready ({time.perf_counter() - started:.0f}s)")
        step = 5 if dry else 41  # prompts of 12 to 135 tokens on the GPU
        prompts = [
            p[: 12 + step * i] for i, p in enumerate(random_prompts(4, 160, shape["vocab_size"], seed=1))
        ]
        equivalence_engine = engines[not dry]  # with CUDA graphs on the GPU
        report["hf_equivalence_bf16"] = hf_equivalence(
            hf_model, equivalence_engine, prompts, 8 if dry else 32, device
        )
        log(f"equivalence done ({time.perf_counter() - started:.0f}s)")
        decode: dict[str, Any] = {"prompt_len": 128 if not dry else 8, "new_tokens": [short, long]}
        for batch in batches:
            prompts = random_prompts(batch, decode["prompt_len"], shape["vocab_size"], seed=batch)
            row = {"hf_generate": hf_tokens_per_s(hf_model, prompts, short, long, device)}
            for graphs, engine in engines.items():
                row["ours_cuda_graphs" if graphs else "ours_eager"] = engine_tokens_per_s(
                    engine, prompts, short, long, device
                )
            row["ours_best_over_hf"] = (
                max(v for k, v in row.items() if k.startswith("ours")) / row["hf_generate"]
            )
            if True in engines:
                row["graphs_over_eager"] = row["ours_cuda_graphs"] / row["ours_eager"]
            decode[f"batch_{batch}"] = row
            log(f"decode batch {batch}: {row} ({time.perf_counter() - started:.0f}s)")
        report["decode_tokens_per_s_smollm2_shape"] = decode
        del hf_model, engines
    if device.type == "cuda":
        torch.cuda.empty_cache()
    copy = copy_bandwidth(device, 1 << 16 if dry else 1 << 30)
    report["copy_bandwidth"] = copy
    report["decode_attention_bandwidth"] = attention_bandwidth(
        device, 2 if dry else 64, 64 if dry else 4096, copy
    )
    log(f"attention bandwidth done ({time.perf_counter() - started:.0f}s)")
    if not args.skip_8b:
        eight_b = TINY if dry else LLAMA3_8B
        report["llama3_8b_shape_batch1"] = roofline_8b(
            device, eight_b, copy, graphs=not dry, steps=4 if dry else 64
        )
    report["seconds"] = time.perf_counter() - started
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
