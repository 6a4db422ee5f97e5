"""Turns a scheduled step into one flat ragged batch, runs the model and returns logits.

For a step with a decode of request A (context 37) and a prefill chunk of B (tokens 16..47):

    input_ids     [ a36 | b16 b17 ... b47 ]          T = 1 + 32 tokens, no padding
    positions     [ 36  | 16  17  ... 47  ]
    slot_mapping  [ A.block_ids[36 // 16] * 16 + 36 % 16 | B.block_ids[1] * 16 + 0 ... ]
    query_start   [ 0, 1, 33 ]
    seq_lens      [ 37, 48 ]
    block_tables  [ A.block_ids + pad ; B.block_ids + pad ]

Only the last token of a request whose prompt is now fully computed is turned into logits.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

from worker.attention import (
    AttentionMetadata,
    TorchPagedAttention,
    allocate_kv_cache,
    kv_cache_bytes_per_block,
)
from worker.config import EngineConfig
from worker.models.config import ModelConfig
from worker.models.cpu_packing import can_pack, pack_linears
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import load_model
from worker.request import Request
from worker.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


class StepRunner(Protocol):
    """What the engine needs from a runner: run one scheduled step, return logits to sample from."""

    device: torch.device

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], torch.Tensor]: ...


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        """Run one step; return the requests that need a new token and their logits [N, V] fp32."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Request] = []
        # Decodes longest first: the attention backend buckets runs of similar length (less padding).
        num_decodes = sum(1 for r in out.scheduled if out.num_scheduled_tokens[r.request_id] == 1)
        decodes = sorted(out.scheduled[:num_decodes], key=lambda r: -r.num_tokens)
        scheduled = decodes + out.scheduled[num_decodes:]
        for request in scheduled:
            start = request.num_computed_tokens
            num_new = out.num_scheduled_tokens[request.request_id]
            end = start + num_new
            input_ids.extend(request.all_token_ids[start:end])
            span = range(start, end)
            positions.extend(span)
            block_ids = request.block_ids
            slot_mapping.extend(block_ids[p // bs] * bs + p % bs for p in span)
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if end == request.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
                sampled.append(request)

        max_blocks = max(len(r.block_ids) for r in scheduled)
        block_tables = torch.tensor(
            [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in scheduled], dtype=torch.int64
        )

        device = self.device
        meta = AttentionMetadata.build(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables.to(device),
            num_decodes=num_decodes,
            block_size=bs,
            sliding_window=self.model.config.sliding_window,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.kv_caches,
            meta,
        )
        if not sampled:
            return [], torch.empty(0)
        index = torch.tensor(logits_indices, dtype=torch.int64, device=device)
        return sampled, self.model.compute_logits(hidden.index_select(0, index))


def build_model_runner(config: EngineConfig, model_path: Path) -> tuple[ModelRunner, ModelConfig, int]:
    """Load the model, size and allocate its KV cache: (runner, model config, number of KV blocks)."""
    device = torch.device(config.device)
    attention = TorchPagedAttention()
    model, model_config = load_model(model_path, config.torch_dtype, device, attention)
    if can_pack(model):
        pack_linears(model)
    mc = model_config
    bytes_per_block = kv_cache_bytes_per_block(
        mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, config.torch_dtype
    )
    num_blocks = config.num_kv_blocks or int(config.kv_cache_gb * 1024**3) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_gb: {config.kv_cache_gb} GiB holds no {bytes_per_block}-byte block")
    kv_caches = allocate_kv_cache(
        mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim, config.torch_dtype, device
    )
    log.info(
        "engine: %s (%s) on %s in %s, attention %s, %d KV blocks of %d tokens (%.2f GiB), prefix caching %s",
        model_path.name,
        mc.architecture,
        device,
        config.dtype,
        type(attention).__name__,
        num_blocks,
        config.block_size,
        num_blocks * bytes_per_block / 1024**3,
        "on" if config.enable_prefix_caching else "off",
    )
    return ModelRunner(model, kv_caches, config.block_size, device), model_config, num_blocks
