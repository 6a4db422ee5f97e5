"""``y = x @ W.T + bias`` with a block-quantized W (Triton, weight-only: W8A16 / W4A16; kinds q8_0, q8_c,
q4_0, q4_1); spec: ``kernels.qlinear_reference.qlinear_dequant_reference``.

Grid ``(M tiles, N tiles)``; a program owns a BLOCK_M x BLOCK_N tile of y and walks K in BLOCK_K steps (a
multiple of the 32-wide quant block that divides K, so no K mask). Each step dequantizes its W tile to
``d q + c`` in fp32 (q8_0: ``d q``), rounds it to x's dtype and ``tl.dot``s it with the x tile into an
fp32 accumulator; the bias is added in fp32 and y rounded once to x's dtype. x is never quantized.

Q4 bytes hold two elements (quant_format.py), so a step loads each byte once and runs two dots, one on
the low nibbles and one on the high, against the x columns they stand for::

    byte p of the tile (p < BLOCK_K / 2)      block b = p // 16, j = p % 16
    low nibble  -> k = k0 + 32 b + j          high nibble -> k = k0 + 32 b + 16 + j
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_format import BLOCK, QuantizedWeight
from kernels.triton_ops.checks import (
    FLOAT_DTYPES,
    check,
    check_float,
    check_last_dim_contiguous,
    check_same_device,
    next_power_of_2,
)
from kernels.triton_ops.interpreter_compat import needs_upcast_dot

# kind -> (quants dtype, whether it has the offset c); the kernel specializes on both. q8_c is ours
# (int8 quants and an offset: what a fused projection of mixed kinds stacks, see quant_format.py).
LAYOUTS = {
    "q8_0": (torch.int8, False),
    "q8_c": (torch.int8, True),
    "q4_0": (torch.uint8, True),
    "q4_1": (torch.uint8, True),
}
NIBBLE_KINDS = ("q4_0", "q4_1")
DECODE_MAX_ROWS = 16  # up to this many rows of x: decode-sized tiles (see choose_blocks)


@triton.jit
def _dot_acc(acc, x, w, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc + x @ w with w [BLOCK_K, BLOCK_N] fp32 rounded to x's dtype first (as the GPU multiplies)."""
    w = w.to(x.dtype)
    if UPCAST_DOT:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, w, acc, input_precision=PRECISION)


@triton.jit
def _qlinear_kernel(
    x_ptr,
    qs_ptr,
    d_ptr,
    c_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_dn,
    stride_cn,
    stride_om,
    NIBBLES: tl.constexpr,
    HAS_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = cols.to(tl.int64)[None, :]  # [1, BLOCK_N]: W's row n is y's column n
    x_mask = row_mask[:, None]
    w_mask = col_mask[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if not NIBBLES:
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
            q = tl.load(qs_ptr + w_cols * stride_qn + k[:, None], mask=w_mask, other=0)
            d = tl.load(d_ptr + w_cols * stride_dn + (k // 32)[:, None], mask=w_mask, other=0.0)
            w = q.to(tl.float32) * d
            if HAS_C:
                w += tl.load(c_ptr + w_cols * stride_cn + (k // 32)[:, None], mask=w_mask, other=0.0)
            acc = _dot_acc(acc, x, w, PRECISION, UPCAST_DOT)
        else:  # q4_0 (c = -8 d) and q4_1 (c = m) alike
            p = tl.arange(0, BLOCK_K // 2)
            block = k0 // 32 + p // 16
            packed = tl.load(qs_ptr + w_cols * stride_qn + (k0 // 2 + p)[:, None], mask=w_mask, other=0)
            d = tl.load(d_ptr + w_cols * stride_dn + block[:, None], mask=w_mask, other=0.0)
            c = tl.load(c_ptr + w_cols * stride_cn + block[:, None], mask=w_mask, other=0.0)
            k_low = k0 + (p // 16) * 32 + p % 16
            x_low = tl.load(x_rows + k_low[None, :], mask=x_mask, other=0.0)
            x_high = tl.load(x_rows + (k_low + 16)[None, :], mask=x_mask, other=0.0)
            w_low = (packed & 0xF).to(tl.float32) * d + c
            w_high = (packed >> 4).to(tl.float32) * d + c
            acc = _dot_acc(acc, x_low, w_low, PRECISION, UPCAST_DOT)
            acc = _dot_acc(acc, x_high, w_high, PRECISION, UPCAST_DOT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=x_mask & w_mask)


def choose_blocks(num_rows: int, num_out: int, num_in: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). Decode (``num_rows <= 16``) is bound by reading W, so it takes 16-row
    tiles (the dot's minimum) and narrow 32-column ones, for more programs streaming W at once; prefill
    takes 64 x 64 tiles, which reuse each dequantized W tile over 64 rows. Tiles shrink to small N;
    BLOCK_K is the largest of 128, 64, 32 that divides K."""
    if num_rows <= DECODE_MAX_ROWS:
        block_m, block_n = 16, 32
    else:
        block_m, block_n = 64, 64
    block_n = min(block_n, max(16, next_power_of_2(num_out)))
    block_k = next(b for b in (128, 64, BLOCK) if num_in % b == 0)
    return block_m, block_n, block_k


def _check_weight(weight: QuantizedWeight) -> tuple[int, int]:
    check(weight.kind in LAYOUTS, f"weight.kind {weight.kind!r}: expected one of {tuple(LAYOUTS)}")
    qs_dtype, has_c = LAYOUTS[weight.kind]
    check(weight.qs.dim() == 2, f"weight.qs: expected 2-d, got shape {tuple(weight.qs.shape)}")
    check(weight.qs.dtype == qs_dtype, f"weight.qs: {weight.kind} needs {qs_dtype}, got {weight.qs.dtype}")
    num_out, num_in = weight.shape
    check(num_in % BLOCK == 0, f"weight: K = {num_in} is not a multiple of {BLOCK}")
    check_last_dim_contiguous("weight.qs", weight.qs)
    check(
        (weight.c is not None) == has_c,
        f"weight.c: a {weight.kind} weight {'needs' if has_c else 'has no'} c",
    )
    scales = {"d": weight.d} if weight.c is None else {"d": weight.d, "c": weight.c}
    for name, t in scales.items():
        expected = (num_out, num_in // BLOCK)
        check(tuple(t.shape) == expected, f"weight.{name}: expected {expected}, got {tuple(t.shape)}")
        check(t.dtype == torch.float32, f"weight.{name}: expected float32, got {t.dtype}")
        check_last_dim_contiguous(f"weight.{name}", t)
    return num_out, num_in


def qlinear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp32/fp16/bf16) -> ``x @ W.T + bias`` [..., N] in x's dtype, W [N, K] dequantized in the
    kernel. ``bias`` [N], any float dtype. 2-d x may have any row stride; other x must be contiguous."""
    num_out, num_in = _check_weight(weight)
    check_float("x", x)
    check(x.dim() >= 1 and x.shape[-1] == num_in, f"x: expected [..., {num_in}], got {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    if x.dim() != 2:
        check(x.is_contiguous(), f"x: a {x.dim()}-d input must be contiguous")
    tensors = {"x": x, "weight.qs": weight.qs, "weight.d": weight.d}
    if weight.c is not None:
        tensors["weight.c"] = weight.c
    if bias is not None:
        check(tuple(bias.shape) == (num_out,), f"bias: expected [{num_out}], got {tuple(bias.shape)}")
        check(bias.dtype in FLOAT_DTYPES, f"bias: dtype {bias.dtype} not in {FLOAT_DTYPES}")
        check_last_dim_contiguous("bias", bias)
        tensors["bias"] = bias
    check_same_device(**tensors)

    rows = x if x.dim() == 2 else x.view(-1, num_in)
    out = torch.empty((*x.shape[:-1], num_out), dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, num_out)
    num_rows = rows.shape[0]
    if num_rows == 0 or num_out == 0:
        return out
    block_m, block_n, block_k = choose_blocks(num_rows, num_out, num_in)
    c = weight.d if weight.c is None else weight.c  # unused without c
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_out, block_n))
    _qlinear_kernel[grid](
        rows,
        weight.qs,
        weight.d,
        c,
        out if bias is None else bias,  # unused without a bias
        out_rows,
        num_rows,
        num_out,
        num_in,
        rows.stride(0),
        weight.qs.stride(0),
        weight.d.stride(0),
        c.stride(0),
        out_rows.stride(0),
        NIBBLES=weight.kind in NIBBLE_KINDS,
        HAS_C=weight.c is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST_DOT=needs_upcast_dot(x.dtype),
        num_warps=4,
    )
    return out
