"""Triton paged attention (decode split-K, prefix prefill) and the Triton backend against the torch
reference, over ragged batches with block sizes, GQA ratios, prefixes, sliding windows and padding.

The reference runs in fp32 on the same (rounded) inputs; ``ATTENTION_TOLERANCES`` bound the difference
per dtype of the Triton side. Tiles are kept small (16 keys) so the loops, splits and their merge are
exercised by contexts of tens of tokens.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import kernels.triton_ops as tk
from kernels import paged_attention as ref
from tests.kernels.triton_cases import ATTENTION_TOLERANCES, make_batch
from worker.attention import (
    AttentionMetadata,
    KernelBackend,
    TorchPagedAttention,
    TritonPagedAttention,
)

SCALE = 0.3


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **ATTENTION_TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_dim", [(8, 2, 4, 32), (16, 1, 3, 24), (4, 3, 1, 16)]
)
def test_decode_matches_reference(
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    num_splits: int,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    seqs = [(97, 1), (40, 1), (17, 1), (1, 1)]  # ragged: several splits, one tile, a lone token
    b = make_batch(seqs, 4, num_kv_heads, group, head_dim, block_size, dtype, device, num_padding=0)
    tk.store_kv(b.key, b.value, b.kv_cache, b.slot_mapping)
    seq_lens = torch.tensor(b.seq_lens, device=device)
    got = tk.paged_decode_attention(
        b.query,
        b.kv_cache,
        b.block_tables,
        seq_lens,
        SCALE,
        max_seq_len=max(b.seq_lens),
        sliding_window=window,
        num_splits=num_splits,
        block_n=16,
    )
    cache32 = b.kv_cache.float().cpu()
    plan = ref.plan_decode(b.block_tables.cpu(), b.seq_lens, block_size, window)
    expected = ref.paged_decode_attention(b.query.float().cpu(), cache32, plan, SCALE)
    _close(got, expected, dtype)


def test_decode_writes_zeros_for_an_empty_sequence_and_into_a_strided_out(device: torch.device) -> None:
    b = make_batch([(30, 1), (5, 1)], 2, 2, 2, 16, 4, torch.float32, device, num_padding=0)
    tk.store_kv(b.key, b.value, b.kv_cache, b.slot_mapping)
    seq_lens = torch.tensor([30, 0], device=device)  # row 1: a padding sequence (CUDA graphs use 1, 0 works)
    wide = torch.full((2, 4, 40), 7.0, device=device)
    out = wide[:, :, :16]
    tk.paged_decode_attention(
        b.query,
        b.kv_cache,
        b.block_tables,
        seq_lens,
        SCALE,
        max_seq_len=30,
        out=out,
        num_splits=3,
        block_n=16,
    )
    plan = ref.plan_decode(b.block_tables[:1].cpu(), [30], 4)
    _close(
        out[:1], ref.paged_decode_attention(b.query[:1].cpu(), b.kv_cache.cpu(), plan, SCALE), torch.float32
    )
    assert torch.equal(out[1].cpu(), torch.zeros(4, 16))
    assert torch.equal(wide[:, :, 16:].cpu(), torch.full((2, 4, 24), 7.0)), "wrote outside out"


PREFILLS = {
    # (context incl. new tokens, new tokens), decodes first
    "no-prefix": (0, [(37, 37), (9, 9)]),
    "prefix": (0, [(50, 13), (33, 1), (40, 22)]),
    "mixed": (2, [(12, 1), (60, 1), (30, 30), (26, 9), (17, 16)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("batch", list(PREFILLS))
@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_dim", [(8, 2, 4, 32), (4, 1, 3, 24), (16, 2, 1, 16)]
)
def test_prefill_matches_reference(
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    batch: str,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    num_decodes, seqs = PREFILLS[batch]
    b = make_batch(seqs, num_decodes, num_kv_heads, group, head_dim, block_size, dtype, device)
    tk.store_kv(b.key, b.value, b.kv_cache, b.slot_mapping)
    starts = b.query_start_loc
    out = torch.full_like(b.query, 5.0)
    tk.paged_prefill_attention(
        b.query,
        b.kv_cache,
        b.block_tables,
        torch.tensor(starts, device=device),
        torch.tensor(b.seq_lens, device=device),
        SCALE,
        first_seq=num_decodes,
        num_seqs=len(seqs),
        max_query_len=max(new for _, new in seqs[num_decodes:]),
        sliding_window=window,
        out=out,
        block_m=4,
        block_n=16,
    )
    plans = ref.plan_prefill(b.block_tables.cpu(), starts, b.seq_lens, block_size, num_decodes, window)
    k32, v32 = b.key.float().cpu(), b.value.float().cpu()
    expected = ref.paged_prefill_attention(
        b.query.float().cpu(), k32, v32, b.kv_cache.float().cpu(), plans, SCALE
    )
    first = starts[num_decodes]
    _close(out[first : starts[-1]], expected, dtype)
    untouched = torch.cat([out[:first], out[starts[-1] :]])
    assert torch.equal(untouched.cpu(), torch.full_like(untouched.cpu(), 5.0)), "wrote outside the chunks"


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block_size,num_kv_heads,group", [(4, 2, 3), (16, 1, 4)])
def test_triton_backend_matches_torch_backend(
    block_size: int, num_kv_heads: int, group: int, window: int | None, device: torch.device
) -> None:
    """The whole backend (store, decode, prefill, padding rows) on a mixed step, as the runner calls it."""
    seqs = [(45, 1), (3, 1), (30, 30), (26, 9), (17, 16)]
    b = make_batch(seqs, 2, num_kv_heads, group, 32, block_size, torch.float32, device, num_padding=2)

    def run(backend: KernelBackend, attention: TorchPagedAttention | TritonPagedAttention) -> tuple:
        cache = b.kv_cache.clone()
        meta = AttentionMetadata.build(
            slot_mapping=b.slot_mapping,
            query_start_loc=b.query_start_loc,
            seq_lens=b.seq_lens,
            block_tables=b.block_tables,
            num_decodes=b.num_decodes,
            block_size=block_size,
            sliding_window=window,
            backend=backend,
        )
        return attention.forward(b.query, b.key, b.value, cache, meta, SCALE), cache

    got, got_cache = run(KernelBackend.TRITON, TritonPagedAttention())
    expected, expected_cache = run(KernelBackend.TORCH, TorchPagedAttention())
    assert torch.equal(got_cache, expected_cache)
    _close(got, expected, torch.float32)
    assert torch.equal(got[-2:].cpu(), torch.zeros(2, num_kv_heads * group, 32))


def test_backend_refuses_torch_metadata(device: torch.device) -> None:
    b = make_batch([(5, 1)], 1, 1, 1, 16, 4, torch.float32, device, num_padding=0)
    meta = AttentionMetadata.build(
        slot_mapping=b.slot_mapping,
        query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens,
        block_tables=b.block_tables,
        num_decodes=1,
        block_size=4,
    )
    with pytest.raises(ValueError, match=r"KernelBackend\.TRITON"):
        TritonPagedAttention().forward(b.query, b.key, b.value, b.kv_cache, meta, SCALE)


# --- on a GPU: model-sized shapes -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_seqs,context", [(1, 4000), (64, 1000), (7, 333)])
def test_decode_model_shapes_on_gpu(num_seqs: int, context: int) -> None:
    """Llama-3-8B's attention shape (8 kv heads x 4, head_dim 128, blocks of 16) in bf16, default tiling
    and the split heuristic, against the reference in fp32."""
    device = torch.device("cuda")
    seqs = [(context - 37 * i % context or 1, 1) for i in range(num_seqs)]
    b = make_batch(seqs, num_seqs, 8, 4, 128, 16, torch.bfloat16, device, num_padding=0)
    tk.store_kv(b.key, b.value, b.kv_cache, b.slot_mapping)
    got = tk.paged_decode_attention(
        b.query,
        b.kv_cache,
        b.block_tables,
        torch.tensor(b.seq_lens, device=device),
        128**-0.5,
        max_seq_len=max(b.seq_lens),
    )
    plan = ref.plan_decode(b.block_tables, b.seq_lens, 16)
    expected = ref.paged_decode_attention(b.query.float(), b.kv_cache.float(), plan, 128**-0.5)
    _close(got, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_model_shapes_on_gpu() -> None:
    device = torch.device("cuda")
    seqs = [(1500, 700), (900, 900), (300, 1)]
    b = make_batch(seqs, 0, 8, 4, 128, 16, torch.bfloat16, device)
    tk.store_kv(b.key, b.value, b.kv_cache, b.slot_mapping)
    out = tk.paged_prefill_attention(
        b.query,
        b.kv_cache,
        b.block_tables,
        torch.tensor(b.query_start_loc, device=device),
        torch.tensor(b.seq_lens, device=device),
        128**-0.5,
        first_seq=0,
        num_seqs=3,
        max_query_len=900,
    )
    plans = ref.plan_prefill(b.block_tables, b.query_start_loc, b.seq_lens, 16, 0)
    expected = ref.paged_prefill_attention(
        b.query.float(), b.key.float(), b.value.float(), b.kv_cache.float(), plans, 128**-0.5
    )
    _close(out[: b.query_start_loc[-1]], expected, torch.bfloat16)
