"""SiLU-and-multiply (SwiGLU's gate): the torch reference (spec and CPU path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x is [..., 2*I] laid out as ``[gate | up]`` (the fused gate_up projection); returns
    ``silu(gate) * up`` of shape [..., I]."""
    half = x.shape[-1] // 2
    assert x.shape[-1] == 2 * half, f"last dim must be even (gate|up), got {x.shape[-1]}"
    return F.silu(x[..., :half]) * x[..., half:]
