"""RMSNorm and fused residual add + RMSNorm (Triton); spec: ``kernels.rms_norm``.

One program per row. Rounding follows the reference (and Hugging Face) step by step, so bf16 results
differ from it only by the order of the sum of squares::

    s      = round(x + residual)                      the residual stream, stored as the second output
    normed = round(s * rsqrt(mean(s^2) + eps))        reduced in fp32
    out    = round(normed * weight)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops.checks import (
    check,
    check_float,
    check_last_dim_contiguous,
    check_same_device,
    next_power_of_2,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * weight.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def _rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as a 2-d [rows, H] view: 2-d inputs may have any row stride, others must be dense."""
    check_last_dim_contiguous(name, x)
    if x.dim() == 2:
        return x
    check(x.is_contiguous(), f"{name}: a {x.dim()}-d input must be contiguous")
    return x.view(-1, x.shape[-1])


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_float("x", x)
    hidden = x.shape[-1]
    check(weight.shape == (hidden,), f"weight {tuple(weight.shape)} for hidden size {hidden}")
    check(weight.dtype == x.dtype, f"weight dtype {weight.dtype} != x dtype {x.dtype}")
    check_last_dim_contiguous("weight", weight)
    rows = _rows("x", x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, hidden)
    residual_rows = residual_out_rows = rows
    residual_out: torch.Tensor | None = None
    if residual is not None:
        check(
            residual.shape == x.shape and residual.dtype == x.dtype,
            "residual must match x in shape and dtype",
        )
        check_same_device(x=x, residual=residual, weight=weight)
        residual_rows = _rows("residual", residual)
        residual_out = torch.empty_like(out)
        residual_out_rows = residual_out.view(-1, hidden)
    else:
        check_same_device(x=x, weight=weight)
    num_rows = rows.shape[0]
    if num_rows == 0:
        return out, residual_out
    block = next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        rows,
        residual_rows,
        weight,
        out_rows,
        residual_out_rows,
        rows.stride(0),
        residual_rows.stride(0),
        out_rows.stride(0),
        residual_out_rows.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2) + eps))`` over the last dim; x [..., H], weight [H] (x's dtype)."""
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; neither input is modified."""
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual
