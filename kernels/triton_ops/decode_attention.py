"""Paged attention for decode (Triton, flash-decoding style); spec: ``kernels.paged_attention``'s
``paged_decode_attention`` (one new token per sequence, attending over its whole cached context).

Grid ``(sequence, kv head, split)``. A program owns one kv head of one sequence and all G query heads
that share it (GQA: each K/V byte is read once for the group), and one slice of the context::

    context keys   0 ........................................ seq_len
    splits         [ split 0 ][ split 1 ][ split 2 ][ split 3 ]      keys_per_split each
    tiles          [t][t][t]                                         BLOCK_N keys, any number of pages
    key n lives    kv_cache[:, h, block_tables[seq, n // block_size], n % block_size, :]

Each split runs an online softmax over its tiles (base 2: ``exp2(s * scale * log2 e)``) and writes an
unnormalised-free partial: ``o_split = sum p v / sum p`` and ``lse_split = m + log2(sum p)``. A second
kernel merges the splits of each (sequence, head)::

    out = sum_s 2^(lse_s - max lse) * o_s / sum_s 2^(lse_s - max lse)

With one split the first kernel writes the output itself. Splits past a sequence's end (or before its
sliding window) do no work and write ``lse = -inf``. Every tile a program visits holds at least one valid
key, so the running max is finite after the first tile.
"""

from __future__ import annotations

import functools

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
from kernels.triton_ops.interpreter_compat import needs_upcast_dot

LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    sliding_window,
    keys_per_split,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ckv,
    stride_ch,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, seq_len)
    if USE_WINDOW:
        lo = tl.maximum(lo, seq_len - sliding_window)  # keys n > (seq_len - 1) - window

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    k_base = cache_ptr + kv_head * stride_ch
    v_base = k_base + stride_ckv
    table = block_tables_ptr + seq * stride_bt

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    first_tile = lo - lo % BLOCK_N
    for start in range(first_tile, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = (n >= lo) & (n < hi)
        block = tl.load(table + n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * stride_cb + (n % BLOCK_SIZE).to(tl.int64) * stride_cs
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale_log2
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        p_low = p.to(v.dtype)  # P @ V in the cache's dtype, as flash attention does
        if UPCAST_DOT:
            acc = acc * alpha[:, None] + tl.dot(
                p_low.to(tl.float32), v.to(tl.float32), input_precision="ieee"
            )
        else:
            acc = acc * alpha[:, None] + tl.dot(p_low, v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        dst = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: [B, Hq, num_splits, BLOCK_D] fp32 and [B, Hq, num_splits] fp32, contiguous
        part = (seq * NUM_HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    base = (seq * NUM_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key (a padding row): output 0
    w = tl.exp2(lse - m)
    o_mask = s_mask[:, None] & (d < HEAD_DIM)[None, :]  # columns past HEAD_DIM were never written
    o = tl.load(part_out_ptr + (base + s)[:, None] * BLOCK_D + d[None, :], mask=o_mask, other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + seq * stride_ob + head * stride_oh + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device, block_n: int
) -> int:
    """Enough programs to fill the GPU about twice, but no split shorter than one tile. On CPU
    (the interpreter) one split: there is no parallel hardware to fill."""
    if device.type != "cuda":
        return 1
    num_tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    programs = num_seqs * num_kv_heads
    wanted = triton.cdiv(2 * _num_sms(device.index or 0), programs)
    return max(1, min(wanted, num_tiles, MAX_SPLITS))


def default_block_n(head_dim: int, device: torch.device) -> int:
    return 64 if head_dim <= 128 else 32


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """query [B, Hq, D] (one token per sequence, last dim contiguous) -> [B, Hq, D].

    ``seq_lens`` [B] (device) counts each sequence's context including its new token, whose K/V must
    already be in the cache; ``block_tables`` [B, W] lists its blocks. ``max_seq_len`` (host) bounds
    ``seq_lens`` and sizes the splits; a CUDA graph captures with the model's maximum length. A
    ``seq_len`` of 0 yields zeros. ``out`` may be a strided view (rows of a larger output).
    """
    check(query.dim() == 3, f"query: expected [B, Hq, D], got {tuple(query.shape)}")
    check_float("query", query)
    num_seqs, num_heads, head_dim = query.shape
    check_kv_cache(kv_cache, head_dim=head_dim)
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    check(num_heads % num_kv_heads == 0, f"{num_heads} query heads for {num_kv_heads} kv heads")
    check(query.dtype == kv_cache.dtype, f"query dtype {query.dtype} != cache dtype {kv_cache.dtype}")
    check_last_dim_contiguous("query", query)
    check_index("block_tables", block_tables, 2)
    check_index("seq_lens", seq_lens, 1)
    check(
        block_tables.shape[0] >= num_seqs and seq_lens.shape[0] >= num_seqs, "fewer table rows than sequences"
    )
    check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    check(block_tables.shape[1] * block_size >= max_seq_len, "block_tables too narrow for max_seq_len")
    check(sliding_window is None or sliding_window > 0, f"sliding_window {sliding_window}")
    check_same_device(query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    check(out.shape == query.shape and out.dtype == query.dtype, f"out {tuple(out.shape)} {out.dtype}")
    check_last_dim_contiguous("out", out)
    if num_seqs == 0:
        return out

    block_n = block_n or default_block_n(head_dim, query.device)
    check(block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n {block_n}: a power of two >= 16")
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device, block_n)
    check(1 <= num_splits <= MAX_SPLITS, f"num_splits {num_splits} outside 1..{MAX_SPLITS}")
    keys_per_split = triton.cdiv(triton.cdiv(max(max_seq_len, 1), block_n), num_splits) * block_n
    group = num_heads // num_kv_heads
    block_d = max(16, next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused: the kernel writes ``out`` directly
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        sliding_window or 0,
        keys_per_split,
        num_splits,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_G=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SINGLE_SPLIT=num_splits == 1,
        USE_WINDOW=sliding_window is not None,
        PRECISION=precision,
        UPCAST_DOT=needs_upcast_dot(query.dtype),
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=next_power_of_2(num_splits),
        )
    return out


def decode_bytes_read(num_seqs: int, context_len: int, kv_cache: torch.Tensor) -> int:
    """K and V bytes a decode step over ``num_seqs`` sequences of ``context_len`` keys must read."""
    _, num_kv_heads, _, _, head_dim = kv_cache.shape
    return 2 * num_seqs * context_len * num_kv_heads * head_dim * kv_cache.element_size()
