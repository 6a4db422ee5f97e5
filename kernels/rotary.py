"""Rotary position embedding: cos/sin cache construction and the torch reference rotation.

Cache layout (one row per position, vLLM's layout so a Triton kernel can read the same tensor)::

    cos_sin_cache[pos] = [ cos(pos * f_0) ... cos(pos * f_{D/2-1}) | sin(pos * f_0) ... sin(pos * f_{D/2-1}) ]
                           <------------- D/2 ------------------->   <------------- D/2 ------------------->

Two pairings of a head's D dims rotate together under frequency f_i:

    neox (HF Llama, ``rotate_half``):  (x[i], x[i + D/2])     x = [ x0 x1 x2 x3 | x4 x5 x6 x7 ]
    GPT-J (interleaved):               (x[2i], x[2i + 1])     x = [ x0 x1 | x2 x3 | x4 x5 | x6 x7 ]

Both are ``x * cos_full + partner(x) * sin_signed`` where ``partner`` swaps each pair
(neox: ``roll`` by D/2; GPT-J: swap neighbours) and ``sin_signed`` carries the minus sign on the pair's
first element. ``rotary_lookup`` builds the full-width cos/sin once per forward so every layer pays only
three ops (roll, mul, addcmul) for q and k together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type_of(rope_scaling: Mapping[str, Any] | None) -> str:
    """The scaling type named by an HF rope dict (old ``type`` or new ``rope_type`` key)."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    head_dim: int, base: float, scaling: Mapping[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    # YaRN (arXiv 2309.00071) as HF computes it: interpolate low frequencies, extrapolate high ones,
    # ramp between; cos/sin are scaled by an attention factor ("mscale").
    factor = float(scaling["factor"])
    original = int(scaling.get("original_max_position_embeddings") or max_positions)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


def build_cos_sin_cache(
    head_dim: int,
    max_positions: int,
    base: float,
    rope_scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The [num_positions, head_dim] cache (cos half | sin half) for positions 0..num_positions-1.

    ``num_positions`` is ``max_positions``, extended to ``factor * original_max_position_embeddings``
    for yarn (checkpoints often keep the pre-extension ``max_position_embeddings``).
    Computed in float32 exactly as HF does (so bf16 rounding matches), then cast to ``dtype``.
    """
    rope_type = rope_type_of(rope_scaling)
    scaling: Mapping[str, Any] = rope_scaling or {}
    attention_factor = 1.0
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(head_dim, base, scaling, max_positions)
        original = int(scaling.get("original_max_position_embeddings") or max_positions)
        max_positions = max(max_positions, int(original * float(scaling["factor"])))
    else:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
    return cache.to(dtype=dtype, device=device)


def rotary_lookup(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(cos_full, sin_signed)``, each [T, 1, D] (broadcast over heads), for ``rotate``.

    Done once per forward; every layer reuses the pair.
    """
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    if is_neox:
        # pair (i, i + D/2): first element gets -sin
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    # pair (2i, 2i + 1): interleave, the even element gets -sin
    cos_full = torch.stack((cos, cos), dim=-1).flatten(-2)
    sin_signed = torch.stack((-sin, sin), dim=-1).flatten(-2)
    return cos_full, sin_signed


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool = True) -> torch.Tensor:
    """Rotate x [T, H, D] by the ``rotary_lookup`` pair; returns a new tensor."""
    # neox: [x2 | x1] (rotate_half without its sign); GPT-J: swap neighbours
    partner = x.roll(x.shape[-1] // 2, dims=-1) if is_neox else x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return torch.addcmul(x * cos, partner, sin)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] for tokens at ``positions`` [T]."""
    cos, sin = rotary_lookup(positions, cos_sin_cache, is_neox)
    return rotate(q, cos, sin, is_neox), rotate(k, cos, sin, is_neox)
