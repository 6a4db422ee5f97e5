"""Rotary position embedding (Triton); spec: ``kernels.rotary`` (same cos/sin cache, both pairings).

One program per token rotates all its heads, reading ``cos_sin_cache[position]`` (cos half | sin half)
directly, so no per-forward cos/sin tensors are built::

    neox:  (x[i], x[i + D/2])      GPT-J: (x[2i], x[2i + 1])       for i < D/2, frequency f_i
    first  = x_a * cos - x_b * sin
    second = x_b * cos + x_a * sin

Rounding follows the reference's ``addcmul(x * cos, partner, sin)``: the ``x * cos`` product is rounded
to the input dtype before the second product is added in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops.checks import (
    check,
    check_float,
    check_index,
    check_last_dim_contiguous,
    check_same_device,
    next_power_of_2,
)


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    positions_ptr,
    cache_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cache,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_H)
    cos = tl.load(cache_ptr + position * stride_cache + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + position * stride_cache + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    if IS_NEOX:
        first = i
        second = i + HALF
    else:
        first = 2 * i
        second = 2 * i + 1
    mask = (heads < NUM_HEADS)[:, None] & (i < HALF)[None, :]
    row = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    xa = tl.load(row + first[None, :], mask=mask, other=0.0)
    xb = tl.load(row + second[None, :], mask=mask, other=0.0)
    dtype = xa.dtype
    xa = xa.to(tl.float32)
    xb = xb.to(tl.float32)
    out_a = (xa * cos[None, :]).to(dtype).to(tl.float32) - xb * sin[None, :]
    out_b = (xb * cos[None, :]).to(dtype).to(tl.float32) + xa * sin[None, :]
    out_row = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    tl.store(out_row + first[None, :], out_a.to(dtype), mask=mask)
    tl.store(out_row + second[None, :], out_b.to(dtype), mask=mask)


def rotate(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool = True
) -> torch.Tensor:
    """Rotate x [T, H, D] (any token/head strides, last dim contiguous) for tokens at ``positions`` [T];
    returns a new contiguous tensor. ``cos_sin_cache`` [P, D] is ``kernels.rotary.build_cos_sin_cache``."""
    check(x.dim() == 3, f"x: expected [T, H, D], got {tuple(x.shape)}")
    check_float("x", x)
    num_tokens, num_heads, head_dim = x.shape
    check(head_dim % 2 == 0, f"head_dim {head_dim} must be even")
    check(
        cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim, f"cache {tuple(cos_sin_cache.shape)}"
    )
    check(cos_sin_cache.dtype == x.dtype, f"cache dtype {cos_sin_cache.dtype} != x dtype {x.dtype}")
    check_index("positions", positions, 1)
    check(positions.shape[0] == num_tokens, f"positions has {positions.shape[0]} entries, T={num_tokens}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    check_same_device(x=x, positions=positions, cos_sin_cache=cos_sin_cache)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        x,
        out,
        positions,
        cos_sin_cache,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        HALF=half,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_HALF=next_power_of_2(half),
        IS_NEOX=is_neox,
    )
    return out


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] (the reference's signature)."""
    return rotate(q, positions, cos_sin_cache, is_neox), rotate(k, positions, cos_sin_cache, is_neox)
