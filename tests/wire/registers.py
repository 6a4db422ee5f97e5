"""A CPU worker's ``Register`` for tests that need a worker introduced to a gateway: float32 on the
CPU, its KV capacity derived from the layout (``num_kv_blocks * block_size`` tokens, as a real worker
computes it); any other field of ``Register`` by keyword."""

from __future__ import annotations

from typing import Any

from wire.messages import Register


def cpu_register(
    worker_id: str = "w-0",
    *,
    model: str = "m",
    num_kv_blocks: int = 64,
    block_size: int = 16,
    max_model_len: int = 4096,
    max_num_seqs: int = 4,
    pid: int = 1,
    **fields: Any,
) -> Register:
    return Register(
        worker_id=worker_id,
        model=model,
        dtype="float32",
        device="cpu",
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        kv_capacity_tokens=num_kv_blocks * block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        pid=pid,
        **fields,
    )
