"""The attention boundary the model calls: per-step metadata, KV cache allocation, backends.

A step's batch is flat and ragged: T new tokens from B sequences, decodes first::

    seq:              d0   d1   p0 ............ p1 ......
    new tokens:       [x] [x]  [x x x x x]    [x x x]           T = 10, B = 4, num_decodes = 2
    query_start_loc:  0    1    2              7      10
    seq_lens:         d0's context, d1's, p0's (cached prefix + 5), p1's (cached prefix + 3)
    slot_mapping[t]:  where token t's K/V go (block_id * block_size + offset); < 0 = padding token

Everything derived from that (decode gather indices, masks, prefill plans) is computed once per step by
``AttentionMetadata.build`` / ``prepare`` and reused by every layer. What is derived depends on the
backend: the torch reference gets its decode buckets and prefill plans; the Triton kernels get device
copies of ``seq_lens`` and ``query_start_loc`` (they read the ragged layout themselves, with no host sync,
so a decode step can be captured in a CUDA graph).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kernels.paged_attention import (
    DecodeGather,
    PrefillSeq,
    decode_workspace_numel,
    paged_decode_attention,
    paged_prefill_attention,
    plan_decode,
    plan_prefill,
    store_kv,
)


class KernelBackend(enum.Enum):
    TORCH = "torch"  # the references in kernels/*.py: the CPU path
    TRITON = "triton"  # kernels/triton_ops: the CUDA path (or the interpreter on CPU, in tests)


@dataclass(slots=True, frozen=True)
class TorchPlan:
    """What the torch reference reads per step: the decode gather and the prefill chunks, planned once
    per step (never per layer)."""

    has_padding_slots: bool
    decode: DecodeGather | None
    prefills: list[PrefillSeq]


@dataclass(slots=True, frozen=True)
class TritonStepTensors:
    """What the Triton kernels read per step: device tensors, plus host bounds that size their grids."""

    seq_lens: torch.Tensor  # [B] int64
    query_start_loc: torch.Tensor  # [B+1] int64
    max_decode_len: int  # bounds the decodes' seq_lens (a CUDA graph uses the model's maximum)
    max_prefill_query_len: int  # the longest prefill chunk (0: none)


@dataclass(slots=True, frozen=True)
class AttentionMetadata:
    """A flat ragged batch of T new tokens from B sequences. The first num_decodes sequences
    have exactly one new token each (decode); the rest are prefill chunks.

    Made in one call: :meth:`build` checks the batch and has the chosen backend plan it (``plan``:
    a :class:`TorchPlan` or :class:`TritonStepTensors`, what that backend reads and nothing else).
    CUDA-graph capture builds its static metadata directly, with a Triton plan over its buffers.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) of each new token
    query_start_loc: list[int]  # B+1 cumulative new-token counts (python ints)
    seq_lens: list[int]  # B context lengths INCLUDING this step's new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int64 (rows padded with 0)
    num_decodes: int
    block_size: int
    plan: TorchPlan | TritonStepTensors
    sliding_window: int | None = None  # the model's (Mistral); None = full causal attention
    num_padding_tokens: int = 0  # rows of T past query_start_loc[-1] (their output rows are zeros)

    @classmethod
    def build(
        cls,
        *,
        slot_mapping: torch.Tensor,
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        num_decodes: int,
        block_size: int,
        sliding_window: int | None = None,
        backend: KernelBackend = KernelBackend.TORCH,
    ) -> AttentionMetadata:
        """Check the batch and plan it for ``backend``; ``ValueError`` naming what is inconsistent."""
        num_seqs = len(seq_lens)
        if len(query_start_loc) != num_seqs + 1 or query_start_loc[0] != 0:
            raise ValueError(f"query_start_loc must have B+1={num_seqs + 1} entries starting at 0")
        if not 0 <= num_decodes <= num_seqs:
            raise ValueError(f"num_decodes={num_decodes} outside 0..{num_seqs}")
        if block_tables.shape[0] < num_seqs:
            raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
        num_rows, num_tokens = slot_mapping.shape[0], query_start_loc[-1]
        if num_rows < num_tokens:
            raise ValueError(f"slot_mapping has {num_rows} entries for {num_tokens} new tokens")
        for i in range(num_seqs):
            query_len = query_start_loc[i + 1] - query_start_loc[i]
            if query_len < 1 or query_len > seq_lens[i]:
                raise ValueError(f"sequence {i}: {query_len} new tokens for seq_len {seq_lens[i]}")
            if i < num_decodes and query_len != 1:
                raise ValueError(f"decode sequence {i} has {query_len} new tokens, expected 1")
        plan: TorchPlan | TritonStepTensors
        if backend is KernelBackend.TRITON:
            plan = _plan_triton(slot_mapping.device, query_start_loc, seq_lens, num_decodes)
        else:
            plan = _plan_torch(
                slot_mapping, query_start_loc, seq_lens, block_tables, num_decodes, block_size, sliding_window
            )
        padding = num_rows - num_tokens
        return cls(
            slot_mapping,
            query_start_loc,
            seq_lens,
            block_tables,
            num_decodes,
            block_size,
            plan,
            sliding_window,
            padding,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        """New tokens that belong to a sequence (T minus trailing padding)."""
        return self.query_start_loc[-1]


def _plan_torch(
    slot_mapping: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    num_decodes: int,
    block_size: int,
    sliding_window: int | None,
) -> TorchPlan:
    decode = None
    if num_decodes:
        decode = plan_decode(block_tables, seq_lens[:num_decodes], block_size, sliding_window)
    prefills = plan_prefill(
        block_tables,
        query_start_loc,
        seq_lens,
        block_size,
        first_seq=num_decodes,
        sliding_window=sliding_window,
    )
    return TorchPlan(bool((slot_mapping < 0).any()), decode, prefills)


def _plan_triton(
    device: torch.device, query_start_loc: list[int], seq_lens: list[int], num_decodes: int
) -> TritonStepTensors:
    # the kernels skip negative slots themselves: no host-side scan (it would sync the GPU)
    prefill_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(num_decodes, len(seq_lens))]
    return TritonStepTensors(
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64, device=device),
        max_decode_len=max(seq_lens[:num_decodes], default=0),
        max_prefill_query_len=max(prefill_lens, default=0),
    )


class AttentionBackend(Protocol):
    """Stores this step's K/V in a layer's paged cache, then attends. q [T, Hq, D], k/v [T, Hkv, D]."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class TorchPagedAttention:
    """The torch-reference backend: CPU, and the spec any faster backend is tested against.

    Owns a grow-only workspace for the decode gather, reused by every layer and step: a fresh
    allocation of tens of MB per layer costs more in page faults than the gather itself.
    """

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None

    def _decode_workspace(self, kv_cache: torch.Tensor, plan: DecodeGather) -> torch.Tensor:
        numel = decode_workspace_numel(kv_cache, plan)
        ws = self._workspace
        if ws is None or ws.numel() < numel or ws.dtype != kv_cache.dtype or ws.device != kv_cache.device:
            ws = self._workspace = kv_cache.new_empty(numel + numel // 4)  # headroom: fewer regrowths
        return ws

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        plan = meta.plan
        if not isinstance(plan, TorchPlan):
            raise ValueError("TorchPagedAttention needs metadata built with backend=KernelBackend.TORCH")
        store_kv(k, v, kv_cache, meta.slot_mapping, has_padding=plan.has_padding_slots)
        parts: list[torch.Tensor] = []
        if plan.decode is not None:
            workspace = self._decode_workspace(kv_cache, plan.decode)
            parts.append(
                paged_decode_attention(q[: meta.num_decodes], kv_cache, plan.decode, scale, workspace)
            )
        if plan.prefills:
            parts.append(paged_prefill_attention(q, k, v, kv_cache, plan.prefills, scale))
        if meta.num_padding_tokens:
            parts.append(q.new_zeros(meta.num_padding_tokens, q.shape[1], q.shape[2]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class TritonPagedAttention:
    """The Triton backend (kernels/triton_ops): store, split-K decode and prefix-prefill kernels writing
    one preallocated output (decode rows first, then the chunks' rows; padding rows zeroed).

    Issues no host sync and reads only device tensors, so it runs inside a captured CUDA graph. Triton
    is imported on construction only: the CPU path never needs it.
    """

    def __init__(self) -> None:
        import kernels.triton_ops as ops

        self._ops: Any = ops

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        step = meta.plan
        if not isinstance(step, TritonStepTensors):
            raise ValueError("TritonPagedAttention needs metadata built with backend=KernelBackend.TRITON")
        ops = self._ops
        ops.store_kv(k, v, kv_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        num_decodes = meta.num_decodes
        if num_decodes:
            ops.paged_decode_attention(
                q[:num_decodes],
                kv_cache,
                meta.block_tables,
                step.seq_lens,
                scale,
                max_seq_len=step.max_decode_len,
                sliding_window=meta.sliding_window,
                out=out[:num_decodes],
            )
        if num_decodes < meta.num_seqs:
            ops.paged_prefill_attention(
                q,
                kv_cache,
                meta.block_tables,
                step.query_start_loc,
                step.seq_lens,
                scale,
                first_seq=num_decodes,
                num_seqs=meta.num_seqs,
                max_query_len=step.max_prefill_query_len,
                sliding_window=meta.sliding_window,
                out=out,
            )
        if meta.num_padding_tokens:
            out[meta.num_tokens :].zero_()
        return out


def make_attention_backend(backend: KernelBackend) -> AttentionBackend:
    return TritonPagedAttention() if backend is KernelBackend.TRITON else TorchPagedAttention()


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers (K and V)."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One [2, num_kv_heads, num_blocks, block_size, head_dim] tensor per layer (see kernels.paged_attention).

    Zero-filled rather than empty: decode gathers read padding blocks (masked out of the softmax,
    but NaN garbage times a zero weight would still be NaN).
    """
    shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
