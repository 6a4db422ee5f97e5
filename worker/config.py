"""Engine configuration: one typed record, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"
    dtype: str = "bfloat16"
    device: str = "cpu"
    kv_cache_gb: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gb (tests use it to force preemption)
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb: must be positive, got {self.kv_cache_gb}")
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size: expected 8, 16 or 32, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be at least 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
