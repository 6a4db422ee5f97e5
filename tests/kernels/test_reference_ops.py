"""Torch reference ops against naive formulas and Hugging Face's own functions."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama import modeling_llama

from kernels.activation import silu_and_mul
from kernels.paged_attention import slot_view, split_buckets, store_kv
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from kernels.rotary import apply_rotary, build_cos_sin_cache
from worker.attention import AttentionMetadata, TorchPagedAttention, TorchPlan


def _naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.double()
    normed = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * normed.to(x.dtype).double()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (3, 5, 128)])
def test_rms_norm_matches_formula(dtype: torch.dtype, tol: float, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    residual = torch.randn(shape).to(dtype)
    weight = (torch.rand(shape[-1]) + 0.5).to(dtype)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), _naive_rms_norm(x, weight, 1e-6), atol=tol, rtol=tol)

    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, x + residual)  # rounded to dtype exactly like HF's add
    torch.testing.assert_close(
        normed.double(), _naive_rms_norm(x + residual, weight, 1e-5), atol=tol, rtol=tol
    )


def test_rms_norm_is_hf_bit_for_bit_in_bf16() -> None:
    torch.manual_seed(0)
    hf = modeling_llama.LlamaRMSNorm(576, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(576) + 0.5)
    x = (torch.randn(9, 576) * 4).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, hf.weight, 1e-5), hf(x))


def test_silu_and_mul() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 2 * 24)
    gate, up = x[..., :24], x[..., 24:]
    torch.testing.assert_close(silu_and_mul(x), gate * torch.sigmoid(gate) * up)


ROPE_CASES = {
    "default": None,
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rotary_neox_matches_hf(case: str, dtype: torch.dtype) -> None:
    head_dim, base, max_pos = 32, 10000.0, 512
    scaling = ROPE_CASES[case]
    config = transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_theta": base, **(scaling or {"rope_type": "default"})},
    )
    hf_rope = modeling_llama.LlamaRotaryEmbedding(config)
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 511, 3])
    q = torch.randn(len(positions), 4, head_dim).to(dtype)
    k = torch.randn(len(positions), 2, head_dim).to(dtype)

    cos, sin = hf_rope(q, positions[None])  # [1, T, D]
    hf_q, hf_k = modeling_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )  # [1, H, T, D]
    cache = build_cos_sin_cache(head_dim, max_pos, base, scaling, dtype=dtype)
    our_q, our_k = apply_rotary(q, k, positions, cache)
    # bf16: the same rounded cos/sin, one rounding fewer inside addcmul
    tol = 1e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(our_q, hf_q[0].transpose(0, 1), atol=tol, rtol=tol)
    torch.testing.assert_close(our_k, hf_k[0].transpose(0, 1), atol=tol, rtol=tol)


def test_rotary_gptj_interleaved_matches_formula() -> None:
    head_dim, base = 16, 500.0
    torch.manual_seed(0)
    positions = torch.tensor([0, 3, 17])
    q = torch.randn(3, 2, head_dim, dtype=torch.float64)
    k = torch.randn(3, 1, head_dim, dtype=torch.float64)
    cache = build_cos_sin_cache(head_dim, 32, base, None, dtype=torch.float64)
    our_q, our_k = apply_rotary(q, k, positions, cache, is_neox=False)

    def naive(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for t, pos in enumerate(positions.tolist()):
            for i in range(head_dim // 2):
                angle = pos * base ** (-2 * i / head_dim)
                c, s = torch.tensor(angle).cos(), torch.tensor(angle).sin()
                even, odd = x[t, :, 2 * i], x[t, :, 2 * i + 1]
                out[t, :, 2 * i] = even * c - odd * s
                out[t, :, 2 * i + 1] = odd * c + even * s
        return out

    torch.testing.assert_close(our_q, naive(q), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(our_k, naive(k), atol=1e-6, rtol=1e-6)


def test_unknown_rope_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="dynamic"):
        build_cos_sin_cache(16, 8, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


# --- paged attention -------------------------------------------------------------------------------


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float, window: int | None
) -> torch.Tensor:
    """q [Lq, Hq, D] at positions prefix_len.., k/v [L, Hkv, D] -> [Lq, Hq, D], in float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(prefix_len, prefix_len + q.shape[0])[:, None]
    key_pos = torch.arange(k.shape[0])[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


BATCHES = {
    # num_decodes, then (context length, new tokens) per sequence, decodes first
    "decode-only": (4, [(1, 1), (7, 1), (16, 1), (33, 1)]),
    "single-decode": (1, [(21, 1)]),
    "prefill-only": (0, [(9, 9), (18, 5), (5, 1)]),  # a 1-token chunk may also run as a prefill
    "mixed": (2, [(12, 1), (3, 1), (30, 30), (26, 9), (17, 16)]),
    # lengths far apart: the decode plan splits them into buckets (checked below)
    "decode-buckets": (6, [(400, 1), (390, 1), (385, 1), (20, 1), (10, 1), (5, 1)]),
}


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 4)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_dense(
    block_size: int, num_kv_heads: int, group: int, batch: str, window: int | None
) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    num_decodes, seqs = BATCHES[batch]
    head_dim, num_heads, scale = 8, num_kv_heads * group, 0.3
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in seqs) + 8
    kv_cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim)  # garbage in unused slots
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous, out-of-order block tables

    tables, full_kv, qs, ks, vs, slots = [], [], [], [], [], []
    query_start_loc, seq_lens = [0], []
    for ctx, new in seqs:
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        slot = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        k, v = torch.randn(ctx, num_kv_heads, head_dim), torch.randn(ctx, num_kv_heads, head_dim)
        store_kv(k[: ctx - new], v[: ctx - new], kv_cache, slot[: ctx - new])  # the cached prefix
        tables.append(table)
        full_kv.append((k, v))
        qs.append(torch.randn(new, num_heads, head_dim))
        ks.append(k[ctx - new :])
        vs.append(v[ctx - new :])
        slots.append(slot[ctx - new :])
        query_start_loc.append(query_start_loc[-1] + new)
        seq_lens.append(ctx)
    # two padding tokens at the end: their slots are -1 and must not be written
    num_pad = 2
    q = torch.cat([*qs, torch.randn(num_pad, num_heads, head_dim)])
    k = torch.cat([*ks, torch.full((num_pad, num_kv_heads, head_dim), float("nan"))])
    v = torch.cat([*vs, torch.full((num_pad, num_kv_heads, head_dim), float("nan"))])
    slot_mapping = torch.cat([*slots, torch.full((num_pad,), -1)])
    block_tables = torch.zeros(len(seqs), max(map(len, tables)) + 1, dtype=torch.int64)  # extra pad column
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table)

    meta = AttentionMetadata.build(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        num_decodes=num_decodes,
        block_size=block_size,
        sliding_window=window,
    )
    before = kv_cache.clone()
    out = TorchPagedAttention().forward(q, k, v, kv_cache, meta, scale)
    if batch == "decode-buckets" and block_size == 4:
        assert isinstance(meta.plan, TorchPlan) and meta.plan.decode is not None
        assert len(meta.plan.decode.buckets) == 2

    assert out.shape == (q.shape[0], num_heads, head_dim)
    assert not kv_cache.isnan().any(), "a padding token was written"
    flat, flat_before = slot_view(kv_cache), slot_view(before)
    written = torch.cat(slots)
    torch.testing.assert_close(flat[0, written], torch.cat(ks), rtol=0, atol=0)
    torch.testing.assert_close(flat[1, written], torch.cat(vs), rtol=0, atol=0)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])

    for i, (ctx, new) in enumerate(seqs):
        rows = slice(query_start_loc[i], query_start_loc[i + 1])
        expected = _dense_attention(qs[i], *full_kv[i], ctx - new, scale, window)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[-num_pad:], torch.zeros(num_pad, num_heads, head_dim))


def test_metadata_rejects_a_multi_token_decode() -> None:
    with pytest.raises(ValueError, match="decode sequence 0"):
        AttentionMetadata.build(
            slot_mapping=torch.arange(3),
            query_start_loc=[0, 2, 3],
            seq_lens=[2, 1],
            block_tables=torch.zeros(2, 1, dtype=torch.int64),
            num_decodes=1,
            block_size=4,
        )


@settings(max_examples=40, deadline=None)
@given(
    slots=st.lists(st.integers(min_value=-1, max_value=23), min_size=1, max_size=12),
    block_size=st.sampled_from([1, 4, 8]),
)
def test_store_kv_writes_exactly_the_valid_slots(slots: list[int], block_size: int) -> None:
    # distinct valid slots (a real slot mapping never repeats one within a step); -1 may repeat
    slots = [s if s < 0 or s not in slots[:i] else -1 for i, s in enumerate(slots)]
    num_blocks = 24 // block_size
    kv_cache = torch.zeros(2, 2, num_blocks, block_size, 3)
    key = torch.arange(len(slots) * 6, dtype=torch.float32).view(len(slots), 2, 3) + 1
    value = -key
    store_kv(key, value, kv_cache, torch.tensor(slots))
    flat = slot_view(kv_cache)
    for row, slot in enumerate(slots):
        if slot >= 0:
            assert torch.equal(flat[0, slot], key[row]) and torch.equal(flat[1, slot], value[row])
    assert int((flat != 0).any(-1).any(-1).sum()) == 2 * sum(1 for s in slots if s >= 0)


def test_split_buckets_pays_only_when_padding_saved_exceeds_the_cost() -> None:
    assert split_buckets([10, 10, 9, 9], cost=80) == []
    assert split_buckets([100, 98, 97, 5, 3, 2], cost=80) == [3]
    starts = split_buckets([64] * 8 + [32] * 8 + [8] * 8 + [1] * 8, cost=10, max_buckets=4)
    assert starts == [8, 16, 24]
    assert len(split_buckets(list(range(64, 0, -1)), cost=1, max_buckets=4)) == 3
    assert split_buckets([5]) == []
