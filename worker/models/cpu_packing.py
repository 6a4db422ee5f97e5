"""A CPU transform for a built model: Linear weights pre-packed for oneDNN.

PyTorch's plain bf16 matmul on CPU repacks the weight on every call, so a batch-1 decode step reads
and writes every weight twice. Packing once at load makes decode about twice as fast and gives
bit-identical results in bfloat16 (checked in tests). fp32 is left alone: there oneDNN's blocked
kernels round differently from the plain path, and fp32 is what we compare with Hugging Face.

Applied like gpt-fast applies quantization: a transform over a built model, not a flag threaded
through the model code.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from worker.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W held in oneDNN's blocked layout (an opaque mkldnn tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.weight_bytes = weight.numel() * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_pack(model: nn.Module) -> bool:
    """True for a bfloat16 model on CPU when this PyTorch has the oneDNN linear ops."""
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_linears(model: LlamaForCausalLM) -> int:
    """Replace every nn.Linear (and the tied lm_head) by a PackedLinear; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                count += 1
    if model.lm_head is None:
        # The embedding stays for lookups; logits read a packed copy (57 MB for SmolLM2).
        model.lm_head = PackedLinear(model.embed_tokens.weight, None)
        count += 1
    log.info("packed %d linear layers for oneDNN (CPU, bfloat16)", count)
    return count
