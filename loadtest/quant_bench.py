"""``tierserve bench quant``: what quantization does to the embedded model, measured on a fixed text.

    tierserve bench quant --json [--record]

The reference is the embedded model's float32 folder (``models pull``: the GGUF's Q4_1 weights
dequantized exactly), so ``q4_1_native`` (the GGUF served from its own blocks) differs from it only
by the kernel's arithmetic: x quantized per block of 32 to int16 (the default) or int8
(``q4_1_native_int8``, llama.cpp's); ``q4_1_native_kv_bf16`` is ``q4_1_native`` over a bfloat16 KV
cache (``kv_cache_dtype``'s ``auto`` for a quantized model on CPU: K/V rounded to bf16 where they are
stored). ``int8``, ``int4`` (a pool's ``quantization``: Q8_0 and Q4_1 blocks) and ``q4_0`` quantize
the float model on the fly; its weights being the dequantized Q4_1 ones, ``int4`` finds much of their
grid again (a float checkpoint would lose more), ``q4_0`` does not. For each, over the text shipped
with the bench (``loadtest/data/quant_text.txt``), teacher-forced:

  top1_agreement   positions whose most likely next token is the reference's
  ppl_ratio        perplexity of the text ÷ the reference's

and per layer, on the same text, the relative error of each quantized linear's output against the
float product of its exact weight (``layers``: the five worst of each format, and the mean).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from worker.cpu_isa import probe
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import load_model
from worker.models.quant import (
    QUANTIZATION_KINDS,
    QuantLinear,
    quantize_linears,
    set_activation_bits,
    use_quant_kernels,
)
from worker.models.quant_check import layer_errors, prefill_logits
from worker.models.store import DEFAULT_MODEL, default_gguf, kernel_cache_dir, resolve_model

TEXT = Path(__file__).parent / "data" / "quant_text.txt"
WORST_LAYERS = 5


def progress(message: str) -> None:
    print(f"[bench quant] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench quant", description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=1024, help="of the text, teacher-forced")
    return parser.parse_args(argv)


def compare(logits: torch.Tensor, reference: torch.Tensor, ids: list[int]) -> dict[str, float]:
    targets = torch.tensor(ids[1:])[:, None]

    def perplexity(x: torch.Tensor) -> float:
        return float(torch.log_softmax(x[:-1], -1).gather(1, targets).mean().neg().exp())

    agreement = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    ppl, ppl_ref = perplexity(logits), perplexity(reference)
    return {"top1_agreement": round(agreement, 4), "ppl_ratio": round(ppl / ppl_ref, 4), "ppl": round(ppl, 3)}


# the model, each linear's exact weight, its KV cache's dtype (None: the model's)
Variant = tuple[LlamaForCausalLM, dict[str, torch.Tensor], torch.dtype | None]


def variants(folder: Path, gguf_folder: Path) -> dict[str, Callable[[], Variant]]:
    """Each format's model, built when called (one in memory at a time), kernels bound, with the
    weights its layers are measured against: the dequantized blocks (native: only the arithmetic
    differs) or the float model's own (on the fly: the weights' quantization too)."""

    def native(bits: int, kv_dtype: torch.dtype | None = None) -> Variant:
        model, _ = load_model(gguf_folder, torch.float32)
        set_activation_bits(model, bits)
        exact = {n: m.dequantized() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        use_quant_kernels(model, probe(), kernel_cache_dir())
        return model, exact, kv_dtype

    def on_the_fly(kind: str) -> Variant:
        model, _ = load_model(folder, torch.float32)
        exact = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        if model.lm_head is None:  # tied: quantize_linears gives the logits a quantized copy
            exact["lm_head"] = model.embed_tokens.weight.detach().clone()
        quantize_linears(model, kind)
        use_quant_kernels(model, probe(), kernel_cache_dir())
        return model, exact, None

    return {
        "q4_1_native": lambda: native(16),
        "q4_1_native_int8": lambda: native(8),
        "q4_1_native_kv_bf16": lambda: native(16, torch.bfloat16),  # kv_cache_dtype = "bfloat16"
        "int8": lambda: on_the_fly(QUANTIZATION_KINDS["int8"]),
        "int4": lambda: on_the_fly(QUANTIZATION_KINDS["int4"]),
        "q4_0": lambda: on_the_fly("q4_0"),
    }


def run(args: argparse.Namespace) -> dict[str, object]:
    folder = resolve_model(DEFAULT_MODEL)
    gguf_folder = resolve_model(str(default_gguf(progress)))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder).encode(TEXT.read_text())[: args.max_tokens]
    progress(f"{len(ids)} tokens of {TEXT.name}; reference: {folder} in float32")
    reference_model, _ = load_model(folder, torch.float32)
    reference = prefill_logits(reference_model, ids)
    del reference_model
    figures: dict[str, object] = {"scenario": "quant", "model": DEFAULT_MODEL, "tokens": len(ids)}
    layers: dict[str, dict[str, float]] = {}
    for name, build in variants(folder, gguf_folder).items():
        model, exact, kv_dtype = build()
        with layer_errors(model, exact) as errors:
            logits = prefill_logits(model, ids, kv_dtype)
        figures[name] = compare(logits, reference, ids)
        worst = sorted(errors.items(), key=lambda kv: -kv[1])[:WORST_LAYERS]
        layers[name] = {"mean": round(sum(errors.values()) / len(errors), 6)}
        layers[name] |= {layer: round(error, 6) for layer, error in worst}
        progress(f"{name}: {figures[name]}, layer error mean {layers[name]['mean']}")
        del model, exact
    figures["layers"] = layers
    figures["reference_ppl"] = compare(reference, reference, ids)["ppl"]
    return figures
