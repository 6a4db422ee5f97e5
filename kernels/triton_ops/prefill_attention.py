"""Paged attention for prefill chunks with a cached prefix (Triton); spec: ``kernels.paged_attention``'s
``paged_prefill_attention``.

A varlen batch: sequence i has ``q_len`` new tokens (rows ``query_start_loc[i]..[i+1]`` of the flat batch)
at positions ``prefix .. seq_len - 1`` (``prefix = seq_len - q_len`` tokens were cached before this step).
The chunk's own K/V are already in the cache, so every key is read through the block table::

    keys      0 ........ prefix-1 | prefix ........ seq_len-1
              cached prefix: all     this chunk: causal (key <= query position)
              visible to every query (and, with a sliding window, key > position - window)

Grid ``(sequence, query tile, kv head)``. A tile is BLOCK_M new tokens times the G query heads of one kv
head, packed as rows ``token * BLOCK_G + g`` so K/V are loaded once for the group. Tiles past a sequence's
chunk do no work (the grid is sized by the longest chunk). The key loop stops at the tile's last query
position; rows that see no key in a tile are kept finite by the ``m == -inf`` guard.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops.checks import (
    check,
    check_float,
    check_index,
    check_kv_cache,
    check_last_dim_contiguous,
    check_same_device,
    next_power_of_2,
)
from kernels.triton_ops.decode_attention import LOG2E
from kernels.triton_ops.interpreter_compat import needs_upcast_dot


@triton.jit
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    sliding_window,
    first_seq,
    stride_qt,
    stride_qh,
    stride_ckv,
    stride_ch,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = first_seq + tl.program_id(0).to(tl.int64)
    tile_start = tl.program_id(1) * BLOCK_M
    kv_head = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix = seq_len - q_len

    r = tl.arange(0, BLOCK_M * BLOCK_G)
    token = tile_start + r // BLOCK_G  # index within the chunk
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row_mask = (token < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    rows = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    position = prefix + token

    # keys this tile needs: [lo, hi); nothing when the tile is past the chunk
    hi = tl.minimum(seq_len, prefix + tile_start + BLOCK_M)
    hi = tl.where(tile_start < q_len, hi, 0)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(prefix + tile_start - sliding_window + 1, 0)

    k_base = cache_ptr + kv_head * stride_ch
    v_base = k_base + stride_ckv
    table = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo - lo % BLOCK_N, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = (n >= lo) & (n < hi)
        block = tl.load(table + n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        key_rows = block * stride_cb + (n % BLOCK_SIZE).to(tl.int64) * stride_cs
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_base + key_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale_log2
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        allowed = valid[None, :] & (n[None, :] <= position[:, None])
        if USE_WINDOW:
            allowed = allowed & (n[None, :] > position[:, None] - sliding_window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + key_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        p_low = p.to(v.dtype)  # P @ V in the cache's dtype, as flash attention does
        if UPCAST_DOT:
            acc = acc * alpha[:, None] + tl.dot(
                p_low.to(tl.float32), v.to(tl.float32), input_precision="ieee"
            )
        else:
            acc = acc * alpha[:, None] + tl.dot(p_low, v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 16,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention for the chunks of sequences ``first_seq .. num_seqs - 1`` of a flat batch.

    query [T, Hq, D] holds the whole batch (decodes first); ``query_start_loc`` [B+1] and ``seq_lens`` [B]
    are device tensors; the chunks' K/V must already be stored. Writes each chunk's rows of ``out``
    [T, Hq, D] (allocated when None; other rows are left untouched) and returns it.
    ``max_query_len`` (host) bounds the chunks' lengths and sizes the grid.
    """
    check(query.dim() == 3, f"query: expected [T, Hq, D], got {tuple(query.shape)}")
    check_float("query", query)
    num_tokens, num_heads, head_dim = query.shape
    check_kv_cache(kv_cache, head_dim=head_dim)
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    check(num_heads % num_kv_heads == 0, f"{num_heads} query heads for {num_kv_heads} kv heads")
    check(query.dtype == kv_cache.dtype, f"query dtype {query.dtype} != cache dtype {kv_cache.dtype}")
    check_last_dim_contiguous("query", query)
    check_index("block_tables", block_tables, 2)
    check_index("query_start_loc", query_start_loc, 1)
    check_index("seq_lens", seq_lens, 1)
    check(0 <= first_seq <= num_seqs, f"first_seq {first_seq} outside 0..{num_seqs}")
    check(query_start_loc.shape[0] >= num_seqs + 1 and seq_lens.shape[0] >= num_seqs, "short metadata")
    check(block_tables.shape[0] >= num_seqs and block_tables.stride(1) == 1, "block_tables rows")
    check(sliding_window is None or sliding_window > 0, f"sliding_window {sliding_window}")
    check(block_m & (block_m - 1) == 0 and block_n >= 16 and block_n & (block_n - 1) == 0, "tile sizes")
    check_same_device(query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    check(out.shape == query.shape and out.dtype == query.dtype, f"out {tuple(out.shape)} {out.dtype}")
    check_last_dim_contiguous("out", out)
    if num_seqs == first_seq or num_tokens == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = next_power_of_2(group)
    block_m = max(block_m, triton.cdiv(16, block_g))  # the dot needs at least 16 rows
    grid = (num_seqs - first_seq, triton.cdiv(max_query_len, block_m), num_kv_heads)
    _prefill_kernel[grid](
        query,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2E,
        sliding_window or 0,
        first_seq,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST_DOT=needs_upcast_dot(query.dtype),
        num_warps=4,
        num_stages=2,
    )
    return out
