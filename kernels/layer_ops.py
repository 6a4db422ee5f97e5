"""The per-layer ops a model calls besides attention and matmuls, as one swappable bundle.

``TorchLayerOps`` is the reference (the CPU path, unchanged); ``kernels.triton_ops.layer_ops`` has the
Triton twin with the same methods. A model holds one bundle and a transform swaps it (gpt-fast style),
so the model code has no backend branches. Rotary is split in two: ``rotary_setup`` once per forward
(the reference builds full-width cos/sin there; Triton just keeps the positions), ``rotate`` per layer.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kernels.activation import silu_and_mul
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from kernels.rotary import rotary_lookup, rotate


class LayerOps(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary_setup(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> Any: ...

    def rotate(self, x: torch.Tensor, rope: Any) -> torch.Tensor: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...


class TorchLayerOps:
    """The torch references, bound as static methods: the CPU path pays one attribute lookup per op,
    no extra Python frame (a batch-1 CPU decode step is bound by per-op overhead)."""

    name = "torch"
    rms_norm = staticmethod(rms_norm)
    fused_add_rms_norm = staticmethod(fused_add_rms_norm)
    rotary_setup = staticmethod(rotary_lookup)  # -> (cos_full, sin_signed), neox pairing
    silu_and_mul = staticmethod(silu_and_mul)

    @staticmethod
    def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return rotate(x, rope[0], rope[1])
