"""Shared helpers for the Triton kernel tests: tolerances per dtype and random paged batches."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kernels.paged_attention import store_kv

# Differences from the reference come from summation order and, in half precision, from rounding:
# on GPU a cast rounds to nearest, Triton's CPU interpreter truncates, so bf16 may be off by up to two
# ulps per rounding step (2^-6 relative) and fp16 by a few of its much smaller ulps.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
# Attention sums many products; in fp32 the order changes the last bits of a value of order 1.
ATTENTION_TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


@dataclass
class PagedBatch:
    """A flat ragged batch over a shuffled paged cache whose prefixes are already stored."""

    kv_cache: torch.Tensor
    query: torch.Tensor  # [T + pad, Hq, D]
    key: torch.Tensor  # [T + pad, Hkv, D]: the new tokens' K (padding rows NaN)
    value: torch.Tensor
    slot_mapping: torch.Tensor  # [T + pad], -1 for padding
    block_tables: torch.Tensor  # [B, W] int64 (rows padded with 0, one spare column)
    query_start_loc: list[int]
    seq_lens: list[int]
    num_decodes: int
    num_padding: int


def make_batch(
    seqs: list[tuple[int, int]],
    num_decodes: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_padding: int = 2,
    seed: int = 0,
) -> PagedBatch:
    """``seqs``: (context length including the new tokens, new tokens) per sequence, decodes first."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_heads = num_kv_heads * group
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in seqs) + 3
    kv_cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, qs, ks, vs, slots = [], [], [], [], []
    query_start_loc, seq_lens = [0], []
    for ctx, new in seqs:
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        slot = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        store_kv(k[: ctx - new], v[: ctx - new], kv_cache, slot[: ctx - new])
        tables.append(table)
        qs.append(torch.randn(new, num_heads, head_dim, generator=gen).to(dtype))
        ks.append(k[ctx - new :])
        vs.append(v[ctx - new :])
        slots.append(slot[ctx - new :])
        query_start_loc.append(query_start_loc[-1] + new)
        seq_lens.append(ctx)
    nan = torch.full((num_padding, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(seqs), max(map(len, tables)) + 1, dtype=torch.int64)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table)
    return PagedBatch(
        kv_cache.to(device),
        torch.cat([*qs, torch.randn(num_padding, num_heads, head_dim, generator=gen).to(dtype)]).to(device),
        torch.cat([*ks, nan]).to(device),
        torch.cat([*vs, nan]).to(device),
        torch.cat([*slots, torch.full((num_padding,), -1)]).to(device),
        block_tables.to(device),
        query_start_loc,
        seq_lens,
        num_decodes,
        num_padding,
    )
