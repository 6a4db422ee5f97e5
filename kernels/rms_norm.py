"""RMSNorm: the torch reference (spec and CPU path).

Numerics follow Hugging Face's ``LlamaRMSNorm`` exactly: normalise in float32, cast back to the
input dtype, and only then multiply by the weight (in the input dtype). Multiplying before the
cast would round differently in bf16 and drift from the checkpoints' reference outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2) + eps))`` over the last dim; x is [..., H], weight [H]."""
    # F.rms_norm reduces in float32 for half inputs and rounds its output to the input dtype, which is
    # HF's ``.to(float32) ... .to(input_dtype)`` in one op instead of five (op count is what a batch-1
    # CPU decode step pays for). The weight stays out of it so the multiply happens after the rounding.
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``.

    The sum is the residual stream the next layer adds to; it is rounded to the input dtype before the
    norm sees it, as HF's ``hidden = residual + hidden`` does.
    """
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
