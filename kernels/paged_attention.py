"""Paged KV cache: store and attention, torch references (the spec and the CPU path).

Cache layout, one tensor per layer, head-major so that one kv head's blocks are contiguous rows::

    kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim]     (index 0 = K, 1 = V)

    slot = block_id * block_size + offset     kv_cache.view(2, Hkv, num_blocks * block_size, D)[:, :, slot]

A sequence's block table row lists its blocks in token order; token j of the sequence lives in
block ``table[j // block_size]`` at offset ``j % block_size``::

    table = [7, 2, 9]  block_size = 4      tokens 0..3 -> block 7, 4..7 -> block 2, 8..10 -> block 9
    seq_len = 11                           slot(token 9) = 9 * 4 + 1 = 37

Decode (one new token per sequence) is vectorised. ``plan_decode``, once per model step, groups the
decode sequences into a few buckets of similar length; each layer gathers a bucket's blocks for each kv
head into a reused workspace (``index_select`` into ``out=``: no allocation, no page faults), padding the
bucket's sequences to its longest context, and attends with two batched matmuls::

    workspace[kv, h] = [B_bucket * blocks_per_seq, block_size * D]  ==  K or V as [Hkv, B, L, D]
    scores [Hkv, B, G, L] = q [Hkv, B, G, D] @ K^T        (G query heads share a kv head: no repeat)
    out    [Hkv, B, G, D] = softmax(scores * scale + mask) @ V

Prefill chunks loop per sequence (few per step, each long enough to amortise the loop) and use SDPA.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A bucket costs a fixed number of ops per layer; splitting pays when it saves more padded blocks than
# this many (measured on CPU: ~14 extra ops cost about as much as gathering and attending 80 blocks).
BUCKET_COST_IN_BLOCKS = 80
MAX_DECODE_BUCKETS = 4


@dataclass(slots=True)
class DecodeBucket:
    """Decode sequences ``start..end`` (rows of the decode queries), padded to ``num_keys`` keys."""

    start: int
    end: int
    block_ids: torch.Tensor  # [(end - start) * blocks_per_seq] int64, row-major per sequence
    num_keys: int  # blocks_per_seq * block_size
    key_mask: torch.Tensor  # [1, B_bucket, 1, num_keys] bool: True where the sequence attends that key
    additive_mask: torch.Tensor | None = None  # 0 / -inf float32, made once per step by the first layer
    key_range: tuple[int, int] = (0, 0)  # single-sequence bucket: the keys it attends, [first, last)


@dataclass(slots=True)
class DecodeGather:
    """Per-step plan for batched decode attention (built by ``plan_decode``, shared by all layers)."""

    buckets: list[DecodeBucket]
    num_seqs: int

    @property
    def num_gathered_blocks(self) -> int:
        return sum(b.block_ids.numel() for b in self.buckets)


@dataclass(slots=True)
class PrefillSeq:
    """Per-step plan for one prefill chunk: ``query_end - query_start`` new tokens whose context
    (prefix already cached, then the new tokens) is ``seq_len`` tokens long."""

    query_start: int  # first row of the chunk in the flat token batch
    query_end: int
    seq_len: int
    block_ids: torch.Tensor | None  # [blocks] holding the context; None: no prefix, keys are the new tokens
    mask: torch.Tensor | None  # [query_len, seq_len] bool (True = attend); None: plain causal


def slot_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as [2, num_slots, Hkv, D] (a strided view): row ``slot`` is one token's K/V."""
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    return kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim).transpose(1, 2)


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
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim)
    # a cache of another dtype (kv_cache_dtype: float32 activations over bf16 K/V) rounds here
    flat[0].index_copy_(1, slot_mapping, key.transpose(0, 1).to(kv_cache.dtype))
    flat[1].index_copy_(1, slot_mapping, value.transpose(0, 1).to(kv_cache.dtype))


def _window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    # causal, and within the window: HF/Mistral's `kv_idx > q_idx - sliding_window`
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


def split_buckets(
    num_blocks: list[int], cost: int = BUCKET_COST_IN_BLOCKS, max_buckets: int = MAX_DECODE_BUCKETS
) -> list[int]:
    """Where to start new buckets so gathered blocks + ``cost`` per bucket is small.

    Buckets are contiguous runs of ``num_blocks`` (the runner orders decodes longest first, so sequences
    of similar length sit together). Greedy: repeatedly make the single split that saves the most, while
    it saves more than ``cost``; at most ``max_buckets`` buckets. O(max_buckets * n).
    """
    bounds = [0, len(num_blocks)]
    while len(bounds) - 1 < max_buckets:
        best_saving, best_split = float(cost), None
        for lo, hi in itertools.pairwise(bounds):
            if hi - lo < 2:
                continue
            prefix_max = list(_running_max(num_blocks[lo:hi]))
            suffix_max = list(_running_max(num_blocks[lo:hi][::-1]))[::-1]
            whole = prefix_max[-1] * (hi - lo)
            for k in range(1, hi - lo):  # left = lo..lo+k-1, right = lo+k..hi-1
                saving = whole - prefix_max[k - 1] * k - suffix_max[k] * (hi - lo - k)
                if saving > best_saving:
                    best_saving, best_split = saving, lo + k
        if best_split is None:
            break
        bounds = sorted([*bounds, best_split])
    return bounds[1:-1]


def _running_max(values: list[int]) -> list[int]:
    out, current = [], 0
    for v in values:
        current = max(current, v)
        out.append(current)
    return out


def plan_decode(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    block_size: int,
    sliding_window: int | None = None,
) -> DecodeGather:
    """Plan decode attention for ``len(seq_lens)`` sequences whose table rows are ``block_tables[:B]``.

    Each bucket gathers ``ceil(max(bucket seq_lens) / block_size)`` blocks per sequence; entries past a
    row's own blocks (table padding, usually block 0) are read and masked out.
    """
    num_seqs = len(seq_lens)
    device = block_tables.device
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    if block_tables.shape[1] < max(blocks_needed):
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns; decode needs {max(blocks_needed)}"
        )
    bounds = [0, *split_buckets(blocks_needed), num_seqs]
    buckets = []
    for start, end in itertools.pairwise(bounds):
        blocks_per_seq = max(blocks_needed[start:end])
        num_keys = blocks_per_seq * block_size
        block_ids = block_tables[start:end, :blocks_per_seq].reshape(-1)
        lens = torch.tensor(seq_lens[start:end], dtype=torch.int64, device=device)[:, None]
        key_pos = torch.arange(num_keys, device=device)[None, :]
        key_mask = _window_mask(lens - 1, key_pos, sliding_window)  # the new token sits at seq_len - 1
        seq_len = seq_lens[start]
        first = max(0, seq_len - sliding_window) if sliding_window is not None else 0
        bucket_mask = key_mask.view(1, end - start, 1, num_keys)
        buckets.append(DecodeBucket(start, end, block_ids, num_keys, bucket_mask, None, (first, seq_len)))
    return DecodeGather(buckets, num_seqs)


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


def decode_workspace_numel(kv_cache: torch.Tensor, plan: DecodeGather) -> int:
    """Elements of workspace ``paged_decode_attention`` needs for its largest bucket."""
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    widest = max(b.block_ids.numel() for b in plan.buckets)
    return 2 * num_kv_heads * widest * block_size * head_dim


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: DecodeGather,
    scale: float,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, Hq, D] (one token per sequence) -> [B, Hq, D], attending over the paged cache.

    ``workspace``: a flat tensor of the cache's dtype with at least ``decode_workspace_numel`` elements,
    reused across layers and steps; None allocates one per call.
    """
    _num_seqs, num_heads, head_dim = query.shape
    _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if workspace is None:
        workspace = kv_cache.new_empty(decode_workspace_numel(kv_cache, plan))
    rows = kv_cache.view(2, num_kv_heads, num_blocks, block_size * head_dim)
    outs = []
    for bucket in plan.buckets:
        batch = bucket.end - bucket.start
        if batch == 1:
            outs.append(_decode_one(query[bucket.start], kv_cache, bucket, scale))
            continue
        num_gathered = bucket.block_ids.numel()
        gathered = workspace[: 2 * num_kv_heads * num_gathered * block_size * head_dim].view(
            2, num_kv_heads, num_gathered, block_size * head_dim
        )
        for kv in range(2):
            for head in range(num_kv_heads):
                torch.index_select(rows[kv, head], 0, bucket.block_ids, out=gathered[kv, head])
        key = gathered[0].view(num_kv_heads, batch, bucket.num_keys, head_dim).to(query.dtype)
        value = gathered[1].view(num_kv_heads, batch, bucket.num_keys, head_dim).to(query.dtype)
        q = query[bucket.start : bucket.end].view(batch, num_kv_heads, group, head_dim).transpose(0, 1)
        if bucket.additive_mask is None:
            mask = torch.zeros(bucket.key_mask.shape, dtype=torch.float32, device=query.device)
            bucket.additive_mask = mask.masked_fill_(~bucket.key_mask, float("-inf"))
        scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale + bucket.additive_mask
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        outs.append(torch.matmul(probs, value).permute(1, 0, 2, 3).reshape(batch, num_heads, head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _decode_one(
    query: torch.Tensor, kv_cache: torch.Tensor, bucket: DecodeBucket, scale: float
) -> torch.Tensor:
    """One sequence (batch-1 decode, the latency case): fewest ops, no padding, no mask.

    Every cached key precedes the new token, so attention over the first seq_len keys needs no mask.
    """
    num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[1]
    first, last = bucket.key_range  # [0, seq_len), or the sliding window's suffix of it
    context = kv_cache[:, :, bucket.block_ids].view(2, num_kv_heads, -1, head_dim).to(query.dtype)
    key, value = context[0, :, first:last], context[1, :, first:last]
    q = query.view(num_kv_heads, num_heads // num_kv_heads, head_dim)  # [Hkv, G, D]: G rows per kv head
    # 4-D inputs reach the fused CPU kernel; 3-D ones fall back to the (2x slower) math path
    out = F.scaled_dot_product_attention(q[None], key[None], value[None], scale=scale)
    return out.reshape(1, num_heads, head_dim)


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """query [Lq, Hq, D], key/value [Hkv, Lk, D] -> [Lq, Hq, D]; mask None = causal (Lq == Lk).

    ``enable_gqa`` lets the fused kernel map query head h to kv head h // G itself (HF's repeat_kv
    order); expanding K/V with a stride-0 group dimension instead is 1.5x slower at 1k tokens.
    """
    query_len, num_heads, head_dim = query.shape
    q = query.transpose(0, 1)[None]  # [1, Hq, Lq, D]
    out = F.scaled_dot_product_attention(
        q, key[None], value[None], attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1).reshape(query_len, num_heads, head_dim)


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
    _, num_kv_heads, _, _, head_dim = kv_cache.shape
    outs: list[torch.Tensor] = []
    for plan in plans:
        rows = slice(plan.query_start, plan.query_end)
        if plan.block_ids is None:
            k, v = key[rows].transpose(0, 1), value[rows].transpose(0, 1)
            if kv_cache.dtype != query.dtype:  # as the cache holds them: rounded to its dtype
                k, v = k.to(kv_cache.dtype).to(query.dtype), v.to(kv_cache.dtype).to(query.dtype)
        else:
            # the context (cached prefix + this chunk) is read back from the cache
            context = kv_cache[:, :, plan.block_ids].view(2, num_kv_heads, -1, head_dim).to(query.dtype)
            k, v = context[0, :, : plan.seq_len], context[1, :, : plan.seq_len]
        outs.append(_attend(query[rows], k, v, plan.mask, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
