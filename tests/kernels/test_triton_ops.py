"""Triton norm, rotary, SiLU·mul and KV-store kernels against their torch references (the spec).

On CPU they run under Triton's interpreter (see conftest.py); with a CUDA device, compiled on it.
Tolerances per dtype are in ``triton_cases.TOLERANCES``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import kernels.triton_ops as tk
from kernels import activation, paged_attention, rms_norm, rotary
from tests.kernels.test_reference_ops import ROPE_CASES
from tests.kernels.triton_cases import TOLERANCES

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (3, 5, 96)])
def test_rms_norm_and_fused_add(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
    residual = torch.randn(shape, generator=gen).to(dtype).to(device)
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype).to(device)
    _close(tk.rms_norm(x, weight, 1e-6), rms_norm.rms_norm(x, weight, 1e-6), dtype)

    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = tk.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = rms_norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    _close(out, ref_out, dtype)
    if dtype == torch.float32:
        assert torch.equal(new_residual, ref_residual)  # one fp32 add: exact
    else:
        _close(new_residual, ref_residual, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not change"


def test_rms_norm_reads_strided_rows(device: torch.device) -> None:
    wide = torch.randn(5, 200).to(device)
    x = wide[:, 8:136]  # row stride 200
    weight = torch.rand(128).to(device) + 0.5
    _close(tk.rms_norm(x, weight, 1e-6), rms_norm.rms_norm(x, weight, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 48), (2, 3, 80), (4, 2 * 1100)])
def test_silu_and_mul(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2).to(dtype).to(device)
    _close(tk.silu_and_mul(x), activation.silu_and_mul(x), dtype)


def test_silu_and_mul_strided_rows_and_bad_input(device: torch.device) -> None:
    wide = torch.randn(6, 100).to(device)
    _close(tk.silu_and_mul(wide[:, :64]), activation.silu_and_mul(wide[:, :64]), torch.float32)
    with pytest.raises(ValueError, match="even"):
        tk.silu_and_mul(torch.randn(2, 7).to(device))
    with pytest.raises(ValueError, match="contiguous"):
        tk.silu_and_mul(wide[:, ::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rotary(case: str, is_neox: bool, dtype: torch.dtype, device: torch.device) -> None:
    head_dim, num_q, num_kv, num_tokens = 32, 4, 2, 9
    cache = rotary.build_cos_sin_cache(head_dim, 128, 10000.0, ROPE_CASES[case], dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(2)
    positions = torch.randint(0, cache.shape[0], (num_tokens,), generator=gen).to(device)
    # q and k as slices of one fused qkv output, as the model passes them (token stride (Hq+2Hkv)*D)
    qkv = torch.randn(num_tokens, num_q + 2 * num_kv, head_dim, generator=gen).to(dtype).to(device)
    q, k = qkv[:, :num_q], qkv[:, num_q : num_q + num_kv]
    got_q, got_k = tk.apply_rotary(q, k, positions, cache, is_neox)
    ref_q, ref_k = rotary.apply_rotary(q, k, positions, cache, is_neox)
    _close(got_q, ref_q, dtype)
    _close(got_k, ref_k, dtype)
    if dtype == torch.float32:  # and a rotation really happened
        assert (got_q - q).abs().max() > 0.1


def test_rotary_rejects_a_cache_of_another_dtype(device: torch.device) -> None:
    cache = rotary.build_cos_sin_cache(16, 8, 10000.0, device=device)
    with pytest.raises(ValueError, match="dtype"):
        tk.rotate(
            torch.randn(2, 1, 16).to(torch.bfloat16).to(device), torch.zeros(2, dtype=torch.int64), cache
        )


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 8), (3, 24), (2, 64)])
def test_store_kv_matches_reference_and_skips_padding(
    block_size: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(block_size * 10 + num_kv_heads)
    num_blocks = 48 // block_size
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:11]
    slots[[2, 7]] = -1  # padding tokens, anywhere in the batch
    # key/value as slices of a fused qkv tensor: non-contiguous token and head strides
    qkv = torch.randn(11, 1 + 2 * num_kv_heads, head_dim, generator=gen).to(device)
    qkv[[2, 7]] = float("nan")  # a padding row that were written would poison the cache
    key, value = qkv[:, 1 : 1 + num_kv_heads], qkv[:, 1 + num_kv_heads :]
    expected = cache.clone()
    paged_attention.store_kv(key, value, expected, slots.to(device))
    tk.store_kv(key, value, cache, slots.to(device))
    assert torch.equal(cache, expected)
    assert not cache.isnan().any()


def test_store_kv_checks_its_inputs(device: torch.device) -> None:
    cache = torch.zeros(2, 2, 4, 4, 8).to(device)
    key = torch.zeros(3, 2, 8).to(device)
    slots = torch.zeros(3, dtype=torch.int64).to(device)
    with pytest.raises(ValueError, match="dtypes"):
        tk.store_kv(key.half(), key.half(), cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        tk.store_kv(key, key, cache, slots[:2])
    with pytest.raises(ValueError, match="int32/int64"):
        tk.store_kv(key, key, cache, slots.float())
