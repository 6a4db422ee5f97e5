"""Launcher-side checks shared by the Triton ops: a wrong shape, dtype or stride is our bug, raised
before a kernel reads memory it should not."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_float(name: str, tensor: torch.Tensor) -> None:
    check(tensor.dtype in FLOAT_DTYPES, f"{name}: dtype {tensor.dtype} not in {FLOAT_DTYPES}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    check(len(set(devices.values())) == 1, f"tensors on different devices: {devices}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    check(tensor.stride(-1) == 1, f"{name}: last dim must be contiguous, strides {tuple(tensor.stride())}")


def check_index(name: str, tensor: torch.Tensor, ndim: int) -> None:
    check(tensor.dim() == ndim, f"{name}: expected {ndim}-d, got shape {tuple(tensor.shape)}")
    check(tensor.dtype in (torch.int32, torch.int64), f"{name}: expected int32/int64, got {tensor.dtype}")


def check_kv_cache(
    kv_cache: torch.Tensor, num_kv_heads: int | None = None, head_dim: int | None = None
) -> None:
    """[2, num_kv_heads, num_blocks, block_size, head_dim], K and V halves laid out alike, rows dense."""
    check(kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"kv_cache: bad shape {tuple(kv_cache.shape)}")
    check_float("kv_cache", kv_cache)
    _, heads, _, block_size, dim = kv_cache.shape
    check(
        num_kv_heads is None or heads == num_kv_heads,
        f"kv_cache has {heads} kv heads, expected {num_kv_heads}",
    )
    check(head_dim is None or dim == head_dim, f"kv_cache head_dim {dim}, expected {head_dim}")
    check(block_size & (block_size - 1) == 0, f"kv_cache: block_size {block_size} is not a power of two")
    check_last_dim_contiguous("kv_cache", kv_cache)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
