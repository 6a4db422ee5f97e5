"""The Triton twin of ``kernels.layer_ops.TorchLayerOps`` (same methods, same semantics)."""

from __future__ import annotations

import torch

from kernels.triton_ops import activation, norm, rotary


class TritonLayerOps:
    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.fused_add_rms_norm(x, residual, weight, eps)

    def rotary_setup(
        self, positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return positions, cos_sin_cache  # the kernel reads cache[position] itself

    def rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        positions, cos_sin_cache = rope
        return rotary.rotate(x, positions, cos_sin_cache, is_neox=True)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(x)
