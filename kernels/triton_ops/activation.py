"""SiLU-and-multiply (Triton); spec: ``kernels.activation.silu_and_mul``.

x [rows, 2I] laid out ``[gate | up]``; a 2-d grid of (row, column block)::

    out = round(round(silu(gate)) * up)       (F.silu rounds its output before the multiply)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops.checks import check, check_float, check_last_dim_contiguous, next_power_of_2


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(
        out_ptr + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*I] -> ``silu(gate) * up`` [..., I]. 2-d inputs may have any row stride; others must be
    contiguous."""
    check_float("x", x)
    check(x.dim() >= 1 and x.shape[-1] % 2 == 0, f"last dim must be even (gate|up), got {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    if x.dim() != 2:
        check(x.is_contiguous(), f"x: a {x.dim()}-d input must be contiguous")
    inter = x.shape[-1] // 2
    rows = x if x.dim() == 2 else x.view(-1, 2 * inter)
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, inter)
    if rows.shape[0] == 0 or inter == 0:
        return out
    block = min(1024, next_power_of_2(inter))
    grid = (rows.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](rows, out_rows, rows.stride(0), out_rows.stride(0), inter, BLOCK=block)
    return out
