"""Write new K/V into the paged cache (Triton); spec: ``kernels.paged_attention.store_kv``.

One program per token, all kv heads at once::

    slot = slot_mapping[t]            (< 0: a padding token, nothing is written)
    kv_cache[0, h, slot // block_size, slot % block_size, :] = key[t, h, :]      for every kv head h
    kv_cache[1, h, ...]                                      = value[t, h, :]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops.checks import (
    check,
    check_index,
    check_kv_cache,
    check_last_dim_contiguous,
    check_same_device,
    next_power_of_2,
)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,
    stride_ch,
    stride_cb,
    stride_cs,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # The slot test is broadcast to a block before it joins the mask: Triton 3.9's interpreter rejects
    # a mask that mixes a block with a scalar condition.
    slot_ok = (heads * 0 + slot) >= 0
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :] & slot_ok[:, None]
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = heads[:, None].to(tl.int64) * stride_ch + block * stride_cb + offset * stride_cs + dims[None, :]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(cache_ptr + dst, k, mask=mask)
    tl.store(cache_ptr + stride_ckv + dst, v, mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value [T, Hkv, D] (any token/head strides, last dim contiguous) into ``kv_cache`` at
    ``slot_mapping`` [T]; slots < 0 are skipped inside the kernel (no host-side scan, graph-safe)."""
    check(key.dim() == 3 and key.shape == value.shape, f"key {tuple(key.shape)} / value {tuple(value.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    check_kv_cache(kv_cache, num_kv_heads, head_dim)
    check(key.dtype == value.dtype == kv_cache.dtype, f"dtypes {key.dtype}/{value.dtype}/{kv_cache.dtype}")
    check_index("slot_mapping", slot_mapping, 1)
    check(
        slot_mapping.shape[0] == num_tokens,
        f"slot_mapping has {slot_mapping.shape[0]} entries, T={num_tokens}",
    )
    check_last_dim_contiguous("key", key)
    check_last_dim_contiguous("value", value)
    check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[3],
    )
