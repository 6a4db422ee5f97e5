"""A quantized model measured against its exact weights: each quantized linear's output vs the float
product of the weight it stands for, on a few real tokens.

``Engine.from_config`` runs it once at load on a short calibration text (logged: the mean and the
worst layers); ``tierserve bench quant`` runs it on its fixed text, with the float model's own
weights as the exact ones for formats quantized on the fly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention import AttentionMetadata, KernelBackend, TritonPagedAttention, allocate_kv_cache
from worker.models.llama import DecoderLayer, LlamaForCausalLM
from worker.models.quant import QuantLinear

log = logging.getLogger(__name__)

BLOCK_SIZE = 16
CALIBRATION_TEXT = (
    "The harbour master kept a board with every vessel written on it in chalk. Fishing boats came in "
    "with the tide and needed the crane at once; the cargo ship could wait a few hours. In 1887 the "
    "lighthouse burned 42 litres of oil a night, and its beam swept the water every ten seconds."
)


def prefill_logits(
    model: LlamaForCausalLM, ids: list[int], kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Every position's next-token logits [T, V] (float32), one prefill over a fresh paged cache of
    ``kv_dtype`` (None: the model's dtype)."""
    cfg = model.config
    weight = next(model.parameters())
    dtype, device = weight.dtype, weight.device
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    caches = allocate_kv_cache(
        cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, kv_dtype or dtype, device
    )
    triton = isinstance(cast(DecoderLayer, model.layers[0]).attention, TritonPagedAttention)
    meta = AttentionMetadata.build(
        slot_mapping=torch.arange(len(ids), device=device),
        query_start_loc=[0, len(ids)],
        seq_lens=[len(ids)],
        block_tables=torch.arange(num_blocks, device=device)[None],
        num_decodes=0,
        block_size=BLOCK_SIZE,
        sliding_window=cfg.sliding_window,
        backend=KernelBackend.TRITON if triton else KernelBackend.TORCH,
    )
    with torch.inference_mode():
        positions = torch.arange(len(ids), device=device)
        hidden = model(torch.tensor(ids, device=device), positions, caches, meta)
        return model.compute_logits(hidden).float()


@contextmanager
def layer_errors(
    model: nn.Module, exact_weights: Mapping[str, torch.Tensor] | None = None
) -> Iterator[dict[str, float]]:
    """While open, each QuantLinear's output is compared with the float product of its exact weight
    (``exact_weights`` by module name; None: the layer's own dequantized blocks, made per call),
    relative L2 error, the largest over calls: {module name: error}."""
    errors: dict[str, float] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):

            def hook(
                mod: nn.Module, args: tuple[torch.Tensor], out: torch.Tensor, *, name: str = name
            ) -> None:
                assert isinstance(mod, QuantLinear)
                weight = mod.dequantized() if exact_weights is None else exact_weights[name]
                bias = mod.bias if isinstance(mod.bias, torch.Tensor) else None
                exact = F.linear(args[0].float(), weight.to(args[0].device), bias)
                error = float((out.float() - exact).norm() / exact.norm().clamp_min(1e-30))
                errors[name] = max(errors.get(name, 0.0), error)

            handles.append(module.register_forward_hook(hook))
    try:
        yield errors
    finally:
        for handle in handles:
            handle.remove()


def check_at_load(model: LlamaForCausalLM, ids: list[int], worst: int = 3) -> dict[str, float]:
    """Each quantized linear's error on ``ids`` (the calibration text), logged once."""
    with layer_errors(model) as errors:
        prefill_logits(model, ids)
    if errors:
        top = sorted(errors.items(), key=lambda kv: -kv[1])[:worst]
        log.info(
            "quantized linears vs their exact weights on %d calibration tokens: mean error %.2g, worst %s",
            len(ids),
            sum(errors.values()) / len(errors),
            ", ".join(f"{name} {error:.2g}" for name, error in top),
        )
    return errors
