"""A CPU transform for a built model: Linear weights pre-packed for oneDNN.

PyTorch's plain bf16 matmul on CPU repacks the weight on every call, so a batch-1 decode step reads
and writes every weight twice. Packing once at load makes decode about twice as fast and gives
bit-identical results in bfloat16 (checked in tests). fp32 is left alone: there oneDNN's blocked
kernels round differently from the plain path, and fp32 is what we compare with Hugging Face.

Applied like gpt-fast applies quantization: a transform over a built model, not a flag threaded
through the model code. oneDNN's bf16 path raises on a CPU without AVX-512 or AVX-NE-CONVERT (an AVX2
EPYC, say), so the transform asks the CPU probe first and is skipped there with one log line.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from worker.cpu_isa import CpuCaps
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


def can_pack(model: nn.Module, caps: CpuCaps | None) -> str | None:
    """None when this model can be packed here, else why not. ``caps``: the CPU probe (None off CPU)."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or caps is None:
        return "not a bfloat16 model on CPU"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this PyTorch build has no oneDNN linear ops"
    if not caps.can_pack_bf16:
        return f"oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT; the CPU is {caps.level.label}"
    return None


def pack_linears_if_supported(model: LlamaForCausalLM, caps: CpuCaps | None) -> int:
    """Pack where the CPU can run it (see :func:`can_pack`); one log line when a bf16 model is skipped."""
    why_not = can_pack(model, caps)
    if why_not is None:
        return pack_linears(model)
    if caps is not None and next(model.parameters()).dtype == torch.bfloat16:
        log.info("bf16 linears left unpacked: %s", why_not)
    return 0


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
