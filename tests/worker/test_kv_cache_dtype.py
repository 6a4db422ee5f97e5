"""``kv_cache_dtype``: which dtype the KV cache takes, and what is refused (worker/config.py), and the
torch path over a bfloat16 cache under float32 activations (kernels/paged_attention.py): K/V rounded
where they are stored, attention equal to the float32 path over the same rounded values."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_decode_attention, plan_decode, store_kv
from worker.config import EngineConfig


@pytest.mark.parametrize(
    ("setting", "model", "triton", "quantized", "expected"),
    [
        ("auto", torch.float32, False, True, torch.bfloat16),  # a quantized model on CPU: bf16 K/V
        ("auto", torch.float32, True, True, torch.float32),  # the Triton kernels keep one dtype
        ("auto", torch.float32, False, False, torch.float32),  # float models keep their own
        ("auto", torch.bfloat16, False, False, torch.bfloat16),
        ("float32", torch.float32, False, True, torch.float32),  # a quantized model's full-precision cache
        ("bfloat16", torch.float32, False, False, torch.bfloat16),
    ],
)
def test_the_cache_dtype_by_model_and_path(
    setting: str, model: torch.dtype, triton: bool, quantized: bool, expected: torch.dtype
) -> None:
    assert EngineConfig(kv_cache_dtype=setting).kv_torch_dtype(model, triton, quantized) == expected


def test_pairs_the_kernels_do_not_take_are_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: 'bfloat16' on the Triton kernels"):
        EngineConfig(kv_cache_dtype="bfloat16").kv_torch_dtype(torch.float32, True, False)
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'float32' under a torch\.bfloat16 model"):
        EngineConfig(kv_cache_dtype="float32").kv_torch_dtype(torch.bfloat16, False, False)
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        EngineConfig(kv_cache_dtype="float16")


def test_a_bf16_cache_holds_rounded_kv_and_attends_as_float32_over_them() -> None:
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, head_dim, block_size, num_blocks = 2, 16, 4, 8
    shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
    bf16, f32 = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape)
    tables = torch.tensor([[5, 2], [0, 0]])  # sequence 0: 7 tokens in blocks 5 and 2; sequence 1: 3 in 0
    seq_lens = [7, 3]
    slots = torch.tensor(
        [int(tables[0, t // block_size]) * block_size + t % block_size for t in range(7)] + [0, 1, 2]
    )
    key = torch.randn(10, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(10, num_kv_heads, head_dim, generator=gen)
    store_kv(key, value, bf16, slots)  # rounds into the cache's dtype
    store_kv(key.bfloat16().float(), value.bfloat16().float(), f32, slots)  # the same values, rounded first
    assert torch.equal(bf16.float(), f32)
    query = torch.randn(2, 4, head_dim, generator=gen)
    plan = plan_decode(tables, seq_lens, block_size)
    got = paged_decode_attention(query, bf16, plan, 0.25)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, paged_decode_attention(query, f32, plan, 0.25), rtol=0, atol=0)
