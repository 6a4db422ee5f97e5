"""How many KV blocks a worker allocates: from ``kv_cache_gb`` when it is set, else from the device.

    CPU:   1 GiB (CPU_KV_CACHE_GB)
    CUDA:  gpu_memory_utilization × total memory − memory in use after the weights and a warm-up
           forward of max_num_batched_tokens tokens (its activation peak stays reserved by torch's
           caching allocator, so it is counted as in use)

The CUDA figure counts the whole device, other processes included: two workers sharing a GPU must
be given ``kv_cache_gb`` (or start one after the other). The arithmetic is :func:`kv_budget_bytes`.
"""

from __future__ import annotations

import logging

import torch

from worker.attention import AttentionMetadata, KernelBackend, allocate_kv_cache
from worker.config import EngineConfig
from worker.models.config import ModelConfig
from worker.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

CPU_KV_CACHE_GB = 1.0
GIB = 1024**3


def kv_budget_bytes(total_bytes: int, used_bytes: int, utilization: float) -> int:
    """Bytes left for the KV cache: ``utilization`` × ``total_bytes`` less what is in use already.
    ``ValueError`` (naming the figures and the keys to change) when that leaves nothing."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {utilization}")
    budget = int(utilization * total_bytes) - used_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {utilization} of {total_bytes / GIB:.2f} GiB leaves no room for the "
            f"KV cache: {used_bytes / GIB:.2f} GiB are in use after loading the model (raise "
            "gpu_memory_utilization, or set kv_cache_gb)"
        )
    return budget


def num_kv_blocks(config: EngineConfig, budget_bytes: int, bytes_per_block: int) -> int:
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_gb: {budget_bytes / GIB:.3g} GiB holds no {bytes_per_block}-byte block "
            f"(kv_cache_gb = {config.kv_cache_gb})"
        )
    return num_blocks


def kv_cache_blocks(
    config: EngineConfig,
    model: LlamaForCausalLM,
    mc: ModelConfig,
    device: torch.device,
    backend: KernelBackend,
    bytes_per_block: int,
) -> int:
    """The number of KV blocks to allocate (``num_kv_blocks`` wins, then ``kv_cache_gb``, then the
    device's default above)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if config.kv_cache_gb is not None:
        return num_kv_blocks(config, int(config.kv_cache_gb * GIB), bytes_per_block)
    if device.type != "cuda":
        return num_kv_blocks(config, int(CPU_KV_CACHE_GB * GIB), bytes_per_block)
    num_tokens = min(config.max_num_batched_tokens, config.context_limit(mc.max_position_embeddings))
    warm_up_forward(model, mc, config, device, backend, num_tokens)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(total, total - free, config.gpu_memory_utilization)
    log.info(
        "kv cache: %.2f GiB = %g × %.2f GiB − %.2f GiB in use after the weights and a %d-token warm-up "
        "(peak reserved by torch: %.2f GiB)",
        budget / GIB,
        config.gpu_memory_utilization,
        total / GIB,
        (total - free) / GIB,
        num_tokens,
        torch.cuda.max_memory_reserved(device) / GIB,
    )
    return num_kv_blocks(config, budget, bytes_per_block)


@torch.inference_mode()
def warm_up_forward(
    model: LlamaForCausalLM,
    mc: ModelConfig,
    config: EngineConfig,
    device: torch.device,
    backend: KernelBackend,
    num_tokens: int,
) -> torch.Tensor:
    """One prefill of ``num_tokens`` tokens (the largest step the scheduler makes) into a cache just big
    enough for it, with as many logit rows as a step samples; returns the logits."""
    bs = config.block_size
    num_blocks = -(-num_tokens // bs)
    caches = allocate_kv_cache(
        mc.num_layers, num_blocks, bs, mc.num_kv_heads, mc.head_dim, config.torch_dtype, device
    )
    meta = AttentionMetadata.build(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        query_start_loc=[0, num_tokens],
        seq_lens=[num_tokens],
        block_tables=torch.arange(num_blocks, dtype=torch.int64, device=device).unsqueeze(0),
        num_decodes=0,
        block_size=bs,
        sliding_window=mc.sliding_window,
        backend=backend,
    )
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    hidden = model(torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, caches, meta)
    num_rows = min(config.max_num_seqs, num_tokens)
    return model.compute_logits(hidden[-num_rows:])
