"""``x @ W.T + b`` with a block-quantized weight, weight-only (W8A16 / W4A16): the torch reference for
``kernels/triton_ops/quant_linear.py``. The weight is dequantized exactly (``QuantizedWeight.dequantize``) and
x is used as it is, unlike ``quant_format.qlinear_reference``, the CPU kernel's spec, which also
quantizes x to integers per block.
"""

from __future__ import annotations

import torch

from kernels.quant_format import QuantizedWeight


def qlinear_dequant_reference(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: the product and the bias in float32, rounded once at the end."""
    y = x.float() @ weight.dequantize().to(x.device).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
