"""The serving half of the GPU check (issue 18): ``tierserve serve`` on the device, HTTP in, SSE out.

    python scripts/gpu_serve_check.py --out serve.json    # on a CUDA machine: minutes, nothing downloaded
    python scripts/gpu_serve_check.py --dry-run           # CPU, a tiny model: runs every step's code

1. A random-weight model of SmolLM2-135M's shape (bf16) with a tokenizer trained here (byte-level BPE,
   padded with added tokens to the model's vocabulary), saved as a Hugging Face folder.
2. ``tierserve serve`` with that folder as its only pool and every other key at its default: device
   ``auto`` (CUDA), one worker per GPU, dtype ``auto`` (bf16), the KV cache sized by
   ``gpu_memory_utilization``, CUDA graphs on. The workers' start-up lines (device, KV size, graph
   capture) are kept in the report.
3. Through HTTP with the load generator's client (streamed chat, ``ignore_eos``, greedy): single stream
   (a warm-up, then 4 x 128 tokens) and 64 concurrent x 128 tokens.
4. The engine on the device (tp=1, bf16, CUDA graphs) against the engine on the CPU (float32, torch path)
   on the same weights: greedy tokens identical, or at the first divergence each side's token in the
   other's top 5 (the bf16 rule of scripts/gpu_bench.py's Hugging Face comparison).

In ``--dry-run`` the model is tiny, serve runs on the CPU, and every figure is meaningless (it says so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
sys.path.insert(0, str(SCRIPTS))

import gpu_bench  # noqa: E402  (scripts/ is not a package)

from loadtest.arrivals import ArrivalSpec  # noqa: E402
from loadtest.client import RequestOptions, Target  # noqa: E402
from loadtest.launch import running_server  # noqa: E402
from loadtest.metrics import GroupSummary, summarize  # noqa: E402
from loadtest.peers_bench import duration_of  # noqa: E402
from loadtest.prompt_text import load_tokenizer  # noqa: E402
from loadtest.runner import Bounds, run_load  # noqa: E402
from loadtest.workloads import Api, Workload, WorkloadOptions  # noqa: E402
from wire.config import ServerConfig  # noqa: E402

MODEL = "random-smollm2"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
READY_TIMEOUT_S = 300.0
# Worker start-up lines serve passes on (worker/cli.py STARTUP_LOGGERS), kept in the report.
STARTUP_LINE = re.compile(r"INFO worker\.|tierserve: starting")


def save_tokenizer(folder: Path, vocab_size: int, seed: int = 0) -> None:
    """A byte-level BPE trained on random words, padded with added tokens to exactly ``vocab_size`` ids,
    so every id a random-weight model samples decodes; a ChatML template, ``<|im_end|>`` as end."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(2000)]
    corpus = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(2000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 4000),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing < 0:
        raise ValueError(f"the tokenizer has more than {vocab_size} ids")
    tokenizer.add_tokens([AddedToken(f" w{i}", normalized=False) for i in range(missing)])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def serve_config(folder: Path, dry: bool) -> str:
    """The pool: the defaults on a GPU (what a user gets); small and on the CPU in a dry run."""
    pool = f'[[models.pools]]\nname = "{MODEL}"\npath = "{folder}"\n'
    if dry:
        pool += 'device = "cpu"\ndtype = "float32"\nkv_cache_gb = 0.25\nmax_num_seqs = 8\n'
    return pool


def measure(
    base_url: str, folder: Path, requests: int, concurrency: int, tokens: int, seed: int
) -> GroupSummary:
    """``requests`` streamed chat completions of ``tokens`` tokens each, ``concurrency`` at a time."""
    config = ServerConfig()
    options = RequestOptions(Api.CHAT, True, 0.0, True, {}, READY_TIMEOUT_S)
    target = Target(MODEL, base_url, MODEL, config.default_tier)
    workload = Workload(
        "chat",
        load_tokenizer(str(folder), MODEL),
        Api.CHAT,
        seed,
        WorkloadOptions(output_len=(tokens, tokens)),
    )
    bounds = Bounds(requests, None, concurrency)
    records = asyncio.run(run_load([target], workload, ArrivalSpec(None), seed, bounds, options)).records
    return summarize(records, {t.name: t for t in config.tiers}, duration_of(records)).overall


def figures(group: GroupSummary) -> dict[str, Any]:
    return {
        "ok": f"{group.num_ok}/{group.num_requests}",
        "output_tokens": group.num_output_tokens,
        "output_tok_s": round(group.output_tok_s, 1),
        "ttft_p50_ms": round(group.ttft_ms.p50, 1) if group.ttft_ms.p50 is not None else None,
        "tpot_p50_ms": round(group.tpot_ms.p50, 2) if group.tpot_ms.p50 is not None else None,
    }


def serve_figures(folder: Path, workdir: Path, dry: bool, tokens: int, concurrency: int) -> dict[str, Any]:
    config = workdir / "tierserve.toml"
    config.write_text(serve_config(folder, dry))
    log_path = workdir / "serve.log"
    started = time.monotonic()
    with running_server(["--config", str(config)], log_path, READY_TIMEOUT_S) as server:
        ready_s = time.monotonic() - started
        gpu_bench.log(f"serve ready in {ready_s:.0f} s")
        measure(server.base_url, folder, 1, 1, tokens, seed=2)  # warm-up
        single = measure(server.base_url, folder, 4, 1, tokens, seed=0)
        gpu_bench.log(f"single stream: {figures(single)}")
        burst = measure(server.base_url, folder, concurrency, concurrency, tokens, seed=1)
        gpu_bench.log(f"{concurrency} concurrent: {figures(burst)}")
    startup = [line for line in log_path.read_text().splitlines() if STARTUP_LINE.search(line)]
    return {
        "ready_s": round(ready_s, 1),
        "output_tokens_per_request": tokens,
        "single_stream": figures(single),
        f"concurrent_{concurrency}": figures(burst),
        "startup_log": startup,
    }


def engine(folder: Path, device: torch.device, dtype: str, graphs: bool) -> Any:
    """The Triton kernels on the GPU; the torch path (no C kernels: the reference) on the CPU."""
    backend = {} if device.type == "cuda" else {"kernel_backend": "torch", "cpu_kernels": False}
    return gpu_bench.build_engine(
        folder, device, dtype, 8, graphs, max_model_len=512, kv_cache_gb=0.25, **backend
    )


def device_vs_cpu(folder: Path, device: torch.device, vocab: int, new: int) -> dict[str, Any]:
    """Greedy tokens of the device's engine vs the CPU's float32 engine on the same weights."""
    from wire.sampling import SamplingParams

    prompts = [p[: 12 + 29 * i] for i, p in enumerate(gpu_bench.random_prompts(4, 120, vocab, seed=3))]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=5)
    on_device = engine(
        folder, device, "float32" if device.type == "cpu" else "bfloat16", device.type == "cuda"
    )
    ours = on_device.generate(prompts, params)
    del on_device
    reference = engine(folder, torch.device("cpu"), "float32", False).generate(prompts, params)
    results = []
    for prompt, a, b in zip(prompts, ours, reference, strict=True):
        first = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), None
        )
        ok = first is None or (
            a.token_ids[first] in [t for t, _ in b.logprobs[first].top]
            and b.token_ids[first] in [t for t, _ in a.logprobs[first].top]
        )
        results.append({"prompt_len": len(prompt), "first_divergence": first, "ok": ok})
    return {"passed": all(r["ok"] for r in results), "new_tokens": new, "prompts": results}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, few tokens")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run, or on a GPU")
    device = torch.device("cpu" if dry else "cuda")
    # the dry run's vocabulary is large enough for the load generator's prompt words (loadtest/prompt_text.py)
    shape = {**gpu_bench.TINY, "vocab_size": 2048} if dry else gpu_bench.SMOLLM2
    tokens, concurrency = (8, 4) if dry else (128, 64)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": "cpu (dry run: a tiny model, every figure meaningless)"
        if dry
        else torch.cuda.get_device_name(),
        "gpus": 0 if dry else torch.cuda.device_count(),
        "torch": torch.__version__,
        "model": "SmolLM2-135M shape, random weights" if not dry else "tiny, random weights",
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / MODEL
        folder.mkdir()
        gpu_bench.save_hf_model(shape, folder, torch.float32 if dry else torch.bfloat16)
        save_tokenizer(folder, shape["vocab_size"])
        gpu_bench.log(f"model folder ready ({time.perf_counter() - started:.0f}s)")
        report["serve"] = serve_figures(folder, Path(tmp), dry, tokens, concurrency)
        report["tp1_device_vs_cpu_reference"] = device_vs_cpu(
            folder, device, shape["vocab_size"], 16 if dry else 32
        )
        gpu_bench.log(f"device vs CPU reference: {report['tp1_device_vs_cpu_reference']['passed']}")
    report["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
