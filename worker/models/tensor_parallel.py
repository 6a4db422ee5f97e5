"""Tensor parallelism over torch.distributed: a transform that keeps one rank's shard of a built model.

Megatron's split of a Llama layer across ``world`` ranks, each holding ``1 / world`` of every matrix:

    qkv_proj      column-parallel: this rank's query heads and their K/V heads (rows of the weight)
    o_proj        row-parallel: the same heads' columns, then one all-reduce (the bias added once)
    gate_up_proj  column-parallel: this rank's slice of the gate rows and of the up rows
    down_proj     row-parallel: that slice's columns, then one all-reduce
    logits        vocab-parallel: this rank's rows of the head (or of the tied embedding), all-gathered

The embedding and the norms stay whole on every rank. K/V heads are split when there are at least as
many as ranks; with fewer, each rank keeps the one its query heads read (replicated, as vLLM does), so
a rank's KV cache holds only its heads. Every rank runs the same forward on the same inputs; the
all-reduces are the only communication (gloo on CPU, NCCL on CUDA: the caller's process group).

Float linears only, on the torch path: block-quantized weights and the fused C decode layer are
refused or skipped by the runner (``model_runner.build_model_runner``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from worker.models.config import ModelConfig, UnsupportedModelError
from worker.models.llama import DecoderLayer, LlamaForCausalLM

__all__ = ["RowParallel", "TensorParallelPlan", "VocabParallelHead", "plan_shards", "shard_model"]


@dataclass(frozen=True, slots=True)
class TensorParallelPlan:
    """What rank ``rank`` of ``world`` keeps: global index ranges of heads, MLP channels and vocab."""

    rank: int
    world: int
    q_heads: range
    kv_heads: range
    inter: range
    vocab: range


def plan_shards(config: ModelConfig, rank: int, world: int) -> TensorParallelPlan:
    """This rank's shares; ``UnsupportedModelError`` naming the dimension that does not divide."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    hq, hkv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    for name, size in (("num_attention_heads", hq), ("intermediate_size", inter)):
        if size % world:
            raise UnsupportedModelError(f"{name} {size} does not divide by tensor_parallel_size {world}")
    if hkv % world == 0:
        per_kv = hkv // world
        kv_heads = range(rank * per_kv, (rank + 1) * per_kv)
    elif world % hkv == 0:  # fewer K/V heads than ranks: each rank keeps its query heads' one
        kv_heads = range(rank * hkv // world, rank * hkv // world + 1)
    else:
        raise UnsupportedModelError(
            f"num_key_value_heads {hkv} and tensor_parallel_size {world}: neither divides the other"
        )
    per_q, per_inter = hq // world, inter // world
    per_vocab = -(-config.vocab_size // world)
    return TensorParallelPlan(
        rank=rank,
        world=world,
        q_heads=range(rank * per_q, (rank + 1) * per_q),
        kv_heads=kv_heads,
        inter=range(rank * per_inter, (rank + 1) * per_inter),
        vocab=range(min(rank * per_vocab, config.vocab_size), min((rank + 1) * per_vocab, config.vocab_size)),
    )


class RowParallel(nn.Module):
    """A linear over this rank's slice of the input features; the partial sums all-reduced, the bias
    (kept whole, on every rank) added after, once."""

    def __init__(self, linear: nn.Linear, columns: slice, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.data[:, columns].contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelHead(nn.Module):
    """The logits of this rank's vocabulary rows, gathered from every rank in rank order."""

    def __init__(
        self, weight: torch.Tensor, plan: TensorParallelPlan, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        per = -(-weight.shape[0] // plan.world)  # every rank's slice padded to the same rows
        rows = torch.zeros(per, weight.shape[1], dtype=weight.dtype, device=weight.device)
        rows[: len(plan.vocab)] = weight[plan.vocab.start : plan.vocab.stop]
        self.weight = nn.Parameter(rows, requires_grad=False)
        self.vocab_size, self.world, self.group = weight.shape[0], plan.world, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = torch.nn.functional.linear(hidden, self.weight)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def _rows(weight: torch.Tensor, ranges: list[range]) -> torch.Tensor:
    return torch.cat([weight[r.start : r.stop] for r in ranges]).contiguous()


def _float_linear(layer: DecoderLayer, name: str) -> nn.Linear:
    linear = getattr(layer, name)
    if not isinstance(linear, nn.Linear):
        kind = type(linear).__name__
        raise UnsupportedModelError(f"tensor parallelism takes float linears; {name} is a {kind}")
    return linear


def _shard_layer(layer: DecoderLayer, plan: TensorParallelPlan, group: dist.ProcessGroup | None) -> None:
    d, hq, hkv = layer.head_dim, layer.num_heads, layer.num_kv_heads
    q, kv = plan.q_heads, plan.kv_heads
    qkv_rows = [
        range(q.start * d, q.stop * d),  # query heads
        range((hq + kv.start) * d, (hq + kv.stop) * d),  # their K heads
        range((hq + hkv + kv.start) * d, (hq + hkv + kv.stop) * d),  # their V heads
    ]
    inter = layer.down_proj.in_features
    gate_up_rows = [plan.inter, range(inter + plan.inter.start, inter + plan.inter.stop)]
    for name, rows in (("qkv_proj", qkv_rows), ("gate_up_proj", gate_up_rows)):
        linear = _float_linear(layer, name)
        sharded = nn.Linear(linear.in_features, sum(len(r) for r in rows), bias=linear.bias is not None)
        sharded.weight = nn.Parameter(_rows(linear.weight.data, rows), requires_grad=False)
        if linear.bias is not None:
            sharded.bias = nn.Parameter(_rows(linear.bias.data, rows), requires_grad=False)
        setattr(layer, name, sharded)
    for name, columns in (
        ("o_proj", slice(q.start * d, q.stop * d)),
        ("down_proj", slice(plan.inter.start, plan.inter.stop)),
    ):
        linear = _float_linear(layer, name)
        setattr(layer, name, RowParallel(linear, columns, group))
    layer.num_heads, layer.num_kv_heads = len(q), len(kv)


def shard_model(
    model: LlamaForCausalLM, plan: TensorParallelPlan, group: dist.ProcessGroup | None = None
) -> ModelConfig:
    """Keep ``plan``'s shard of every layer and of the logits, in place; the model's config becomes
    this rank's (its heads and MLP width), which the KV cache is sized from. Returns it."""
    config = model.config
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        _shard_layer(layer, plan, group)
    head_weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    assert isinstance(head_weight, torch.Tensor)
    model.lm_head = VocabParallelHead(head_weight.data, plan, group)
    model.config = dataclasses.replace(
        config,
        num_heads=len(plan.q_heads),
        num_kv_heads=len(plan.kv_heads),
        intermediate_size=len(plan.inter),
    )
    return model.config
