"""Paged KV cache: store and attention, torch references (the spec and the CPU path).

Cache layout, one tensor per layer::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]     (index 0 = K, 1 = V)

    slot = block_id * block_size + offset         kv_cache.view(2, num_blocks * block_size, Hkv, D)[:, slot]

A sequence's block table row lists its blocks in token order; token j of the sequence lives in
block ``table[j // block_size]`` at offset ``j % block_size``::

    table = [7, 2, 9]  block_size = 4      tokens 0..3 -> block 7, 4..7 -> block 2, 8..10 -> block 9
    seq_len = 11                           slot(token 9) = 9 * 4 + 1 = 37

Decode (one new token per sequence) is vectorised: the ``plan_decode`` step, done once per model step,
lists every decode sequence's blocks; each layer then gathers them with one ``index_select``, padding
every sequence to the batch's longest context, and masks the padding in a single SDPA call.
Prefill chunks loop per sequence (few per step, each long enough to amortise the loop).

GQA without copies: query head h reads kv head ``h // G`` (G = Hq / Hkv, HF's ``repeat_kv`` order),
so q viewed as [.., Hkv, G, ..] lines up with an un-repeated K/V of [.., Hkv, 1, ..].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class DecodeGather:
    """Per-step plan for batched decode attention (built by ``plan_decode``, shared by all layers)."""

    block_ids: torch.Tensor  # [B * blocks_per_seq] int64: each decode sequence's first blocks, row-major
    num_seqs: int  # B
    num_keys: int  # blocks_per_seq * block_size: keys per sequence after the gather (padding included)
    key_mask: torch.Tensor  # [B, 1, 1, num_keys] bool: True where the sequence attends that key
    # key_mask as 0 / -inf in the query dtype, made by the first layer that needs it: SDPA would
    # otherwise convert the bool mask in every layer (~15% of a batch-64 decode attention call)
    additive_mask: torch.Tensor | None = None


@dataclass(slots=True)
class PrefillSeq:
    """Per-step plan for one prefill chunk: ``query_end - query_start`` new tokens whose context
    (prefix already cached, then the new tokens) is ``seq_len`` tokens long."""

    query_start: int  # first row of the chunk in the flat token batch
    query_end: int
    seq_len: int
    block_ids: torch.Tensor | None  # [blocks] holding the context; None: no prefix, keys are the new tokens
    mask: torch.Tensor | None  # [query_len, seq_len] bool (True = attend); None: plain causal


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    has_padding: bool = True,
) -> None:
    """Write key/value [T, Hkv, D] into the cache at ``slot_mapping`` [T]; slots < 0 are skipped.

    ``has_padding=False`` promises there is no negative slot and skips the scan (callers that know it,
    from metadata computed once per step, save two ops per layer).
    """
    if has_padding:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    # causal, and within the window: HF/Mistral's `kv_idx > q_idx - sliding_window`
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


def plan_decode(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    block_size: int,
    sliding_window: int | None = None,
) -> DecodeGather:
    """Plan decode attention for ``len(seq_lens)`` sequences whose table rows are ``block_tables[:B]``.

    Every sequence gathers ``ceil(max(seq_lens) / block_size)`` blocks; entries past a row's own blocks
    (table padding, usually block 0) are read and masked out.
    """
    num_seqs = len(seq_lens)
    blocks_per_seq = -(-max(seq_lens) // block_size)
    if block_tables.shape[1] < blocks_per_seq:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns; decode needs {blocks_per_seq}")
    device = block_tables.device
    block_ids = block_tables[:num_seqs, :blocks_per_seq].reshape(-1)
    num_keys = blocks_per_seq * block_size
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)[:, None]
    key_pos = torch.arange(num_keys, device=device)[None, :]
    key_mask = _window_mask(lens - 1, key_pos, sliding_window)  # the new token sits at seq_len - 1
    return DecodeGather(block_ids, num_seqs, num_keys, key_mask.view(num_seqs, 1, 1, num_keys))


def plan_prefill(
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_size: int,
    first_seq: int,
    sliding_window: int | None = None,
) -> list[PrefillSeq]:
    """Plan prefill attention for sequences ``first_seq..`` of the batch (the decodes come first)."""
    device = block_tables.device
    plans: list[PrefillSeq] = []
    for i in range(first_seq, len(seq_lens)):
        start, end, seq_len = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
        query_len = end - start
        prefix_len = seq_len - query_len
        block_ids: torch.Tensor | None = None
        if prefix_len > 0:
            num_blocks = -(-seq_len // block_size)
            if block_tables.shape[1] < num_blocks:
                raise ValueError(
                    f"block_tables has {block_tables.shape[1]} columns; sequence {i} needs {num_blocks}"
                )
            block_ids = block_tables[i, :num_blocks]
        mask: torch.Tensor | None = None
        if prefix_len > 0 or sliding_window is not None:
            query_pos = torch.arange(prefix_len, seq_len, device=device)[:, None]
            key_pos = torch.arange(seq_len, device=device)[None, :]
            mask = _window_mask(query_pos, key_pos, sliding_window)
        plans.append(PrefillSeq(start, end, seq_len, block_ids, mask))
    return plans


def paged_decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, plan: DecodeGather, scale: float
) -> torch.Tensor:
    """query [B, Hq, D] (one token per sequence) -> [B, Hq, D], attending over the paged cache."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    gathered = kv_cache.index_select(1, plan.block_ids).view(
        2, num_seqs, plan.num_keys, num_kv_heads, head_dim
    )
    key = gathered[0].transpose(1, 2)  # [B, Hkv, L, D]
    value = gathered[1].transpose(1, 2)
    mask = plan.additive_mask
    if mask is None or mask.dtype != query.dtype:
        mask = torch.zeros(plan.key_mask.shape, dtype=query.dtype, device=query.device)
        mask.masked_fill_(~plan.key_mask, float("-inf"))
        plan.additive_mask = mask
    # the G query heads sharing a kv head become G "query positions" against that head: no K/V repeat
    out = F.scaled_dot_product_attention(
        query.view(num_seqs, num_kv_heads, group, head_dim), key, value, attn_mask=mask, scale=scale
    )
    return out.view(num_seqs, num_heads, head_dim)


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """query [Lq, Hq, D], key/value [Lk, Hkv, D] -> [Lq, Hq, D]; mask None = causal (Lq == Lk)."""
    query_len, num_heads, head_dim = query.shape
    key_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, Lq, D]
    k = key.transpose(0, 1)[:, None].expand(num_kv_heads, group, key_len, head_dim)  # stride-0 G: no copy
    v = value.transpose(0, 1)[:, None].expand(num_kv_heads, group, key_len, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_dim)


def paged_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    plans: list[PrefillSeq],
    scale: float,
) -> torch.Tensor:
    """Attention for the prefill chunks of a flat batch.

    query [T, Hq, D], key/value [T, Hkv, D] are the whole batch's new tokens (already stored in the
    cache); returns [sum of chunk lengths, Hq, D] for the chunks' rows in plan order.
    """
    num_kv_heads, head_dim = kv_cache.shape[3:]
    outs: list[torch.Tensor] = []
    for plan in plans:
        rows = slice(plan.query_start, plan.query_end)
        if plan.block_ids is None:
            k, v = key[rows], value[rows]
        else:
            # the context (cached prefix + this chunk) is read back from the cache
            context = kv_cache.index_select(1, plan.block_ids).view(2, -1, num_kv_heads, head_dim)
            k, v = context[0, : plan.seq_len], context[1, : plan.seq_len]
        outs.append(_attend(query[rows], k, v, plan.mask, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
