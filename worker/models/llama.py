"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2) on a paged KV cache, gpt-fast style.

Fused projections keep a batch-1 CPU decode step cheap (it is bound by per-op overhead, not FLOPs):

    qkv_proj     [ q: Hq*D | k: Hkv*D | v: Hkv*D ]  x hidden     (one matmul instead of three)
    gate_up_proj [ gate: I | up: I ]                x hidden     (one matmul instead of two)

RoPE is set up once per forward and q and k are rotated together as one [T, Hq+Hkv, D] slice of the
qkv output; the residual add is fused into the following RMSNorm.

The norms, RoPE and SiLU·mul come from a ``LayerOps`` bundle and attention from an ``AttentionBackend``:
the torch references by default (the CPU path); ``use_kernels`` swaps both, e.g. to the Triton kernels
on CUDA, without a backend branch in the model code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.layer_ops import LayerOps, TorchLayerOps
from kernels.rms_norm import rms_norm
from kernels.rotary import build_cos_sin_cache
from worker.attention import AttentionBackend, AttentionMetadata
from worker.models.config import ModelConfig


class RMSNorm(nn.Module):
    """Holds the weight; the layers call the kernels directly (one fewer module call per norm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.attention = attention
        hidden, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * d
        self.qkv_proj = nn.Linear(hidden, qkv_out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, hidden, bias=config.o_proj_bias)
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Any,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.ops
        norm = self.input_layernorm
        if residual is None:  # first layer: the embedding is the residual stream
            residual = hidden
            hidden = ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            hidden, residual = ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)

        num_tokens, num_q = hidden.shape[0], self.num_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, num_q + 2 * self.num_kv_heads, self.head_dim)
        qk = ops.rotate(qkv[:, : num_q + self.num_kv_heads], rope)
        v = qkv[:, num_q + self.num_kv_heads :]
        attn = self.attention.forward(qk[:, :num_q], qk[:, num_q:], v, kv_cache, meta, self.scale)
        hidden = self.o_proj(attn.reshape(num_tokens, num_q * self.head_dim))

        norm = self.post_attention_layernorm
        hidden, residual = ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        hidden = self.down_proj(ops.silu_and_mul(self.gate_up_proj(hidden)))
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """forward: flat ragged batch of new tokens -> final-normed hidden states; compute_logits -> fp32."""

    cos_sin_cache: torch.Tensor

    def __init__(self, config: ModelConfig, attention: AttentionBackend, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.config = config
        self.ops: LayerOps = ops or TorchLayerOps()
        # Unfilled, not random: a loader assigns every weight. (Random fills and arithmetic on the meta
        # device, where the loaders build, run torch's Python references, whose first call imports
        # torch._dynamo and triton: ~1 s of each start, and triton's leak warnings at exit.)
        vocab_by_hidden = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=vocab_by_hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention, self.ops) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # tied: compute_logits reads embed_tokens.weight, so there is one tensor, not two to keep in sync
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        weight = self.embed_tokens.weight
        if weight.device.type != "meta":  # on meta the loader builds it once the weights are real
            self.build_rope_cache(weight.device, weight.dtype)

    def build_rope_cache(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """(Re)build the cos/sin cache; the loader calls it after materialising a meta-built model."""
        cfg = self.config
        cache = build_cos_sin_cache(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dtype, device
        )
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def use_kernels(self, ops: LayerOps, attention: AttentionBackend) -> None:
        """Swap the layer ops and the attention backend of every layer (a transform on a built model)."""
        self.ops = ops
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.ops = ops
            layer.attention = attention

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> hidden [T, hidden_size] (final norm applied)."""
        hidden = self.embed_tokens(input_ids)
        rope = self.ops.rotary_setup(positions, self.cos_sin_cache)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        hidden, _ = self.ops.fused_add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32."""
        if self.lm_head is None:  # tied
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
