"""ModelConfig: the typed subset of a Hugging Face ``config.json`` the Llama-family model needs.

Reads both config styles: transformers < 5 (``rope_theta`` + ``rope_scaling``) and transformers 5
(``rope_parameters: {"rope_type": ..., "rope_theta": ..., <scaling keys>}``). A ``quantization_config``
becomes a :class:`QuantConfig` (4-bit GPTQ or AWQ "gemm", served by ``hf_quant.py``); any other is
refused here, naming the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.rotary import SUPPORTED_ROPE_TYPES, rope_type_of

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this model code does not implement."""


class WeightMismatchError(ValueError):
    """The checkpoint's tensors do not match what the config describes (missing, unexpected, shape)."""


QUANT_METHODS = ("gptq", "awq")
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v1 stores each zero point minus one, v2 the zero point itself
AWQ_VERSIONS = ("gemm",)


@dataclass(slots=True, frozen=True)
class QuantConfig:
    """A GPTQ / AWQ checkpoint's ``quantization_config``, validated: 4-bit groups along K."""

    method: str  # "gptq" | "awq"
    bits: int
    group_size: int | None  # None: one group per row (GPTQ's -1)
    sym: bool
    desc_act: bool  # GPTQ act-order: served only where g_idx keeps the natural order (checked at load)
    checkpoint_format: str  # gptq: "gptq" (v1) | "gptq_v2"; awq: its version, "gemm"


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None = plain RoPE; else has "rope_type" and that type's keys
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    o_proj_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj (Qwen2's does not)
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral: keys older than this many positions are not attended
    quantization: QuantConfig | None = None  # GPTQ / AWQ projections; None: float weights


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        theta = float(params["rope_theta"])
    else:
        scaling = dict(raw.get("rope_scaling") or {})
        theta = float(raw.get("rope_theta", 10000.0))
    rope_type = rope_type_of(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    scaling.pop("type", None)
    scaling["rope_type"] = rope_type
    return theta, scaling


def _quantization(raw: Any) -> QuantConfig | None:
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"quantization_config: expected an object, got {raw!r}")

    def refuse(key: str, why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"quantization_config.{key} = {raw.get(key)!r}: {why}")

    method = str(raw.get("quant_method", "")).lower()
    if method not in QUANT_METHODS:
        raise refuse(
            "quant_method",
            f"served are {', '.join(QUANT_METHODS)} (4-bit); else serve a float checkpoint (with "
            "quantization = 'int8' or 'int4') or a GGUF file (Q8_0, Q4_0, Q4_1)",
        )
    bits_key = "bits" if "bits" in raw or "w_bit" not in raw else "w_bit"  # AutoAWQ's own names
    if raw.get(bits_key) != 4:
        raise refuse(bits_key, f"only 4-bit {method} weights are served")
    group_key = "group_size" if "group_size" in raw or "q_group_size" not in raw else "q_group_size"
    group_size = raw.get(group_key)
    if not isinstance(group_size, int) or not (group_size == -1 or (group_size > 0 and group_size % 32 == 0)):
        raise refuse(group_key, "expected -1 (one group per row) or a multiple of 32")
    if method == "gptq":
        format_key = "checkpoint_format" if "checkpoint_format" in raw or "format" not in raw else "format"
        checkpoint_format = str(raw.get(format_key) or "gptq").lower()
        if checkpoint_format not in GPTQ_FORMATS:
            raise refuse(format_key, f"served are {', '.join(GPTQ_FORMATS)}")
        if raw.get("lm_head"):
            raise refuse("lm_head", "a quantized lm_head is not served")
        sym, desc_act = bool(raw.get("sym", True)), bool(raw.get("desc_act", False))
    else:
        checkpoint_format = str(raw.get("version") or "gemm").lower()
        if checkpoint_format not in AWQ_VERSIONS:
            raise refuse("version", f"served is AWQ {', '.join(AWQ_VERSIONS)}")
        if raw.get("zero_point", True) is not True:
            raise refuse("zero_point", "AWQ without zero points is not served")
        sym, desc_act = False, False
    if str(raw.get("pack_dtype", "int32")) != "int32":
        raise refuse("pack_dtype", "only int32 packing is served")
    return QuantConfig(method, 4, None if group_size == -1 else group_size, sym, desc_act, checkpoint_format)


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    if architecture == "MistralForCausalLM":
        window = raw.get("sliding_window")
        return int(window) if window else None
    if architecture == "Qwen2ForCausalLM" and raw.get("use_sliding_window") and raw.get("sliding_window"):
        # HF ignores sliding_window unless use_sliding_window; then layers from max_window_layers slide
        layer_types = raw.get("layer_types")
        if layer_types is None:
            has_sliding = int(raw.get("max_window_layers", 28)) < int(raw["num_hidden_layers"])
        else:
            has_sliding = "sliding_attention" in layer_types
        if has_sliding:
            raise UnsupportedModelError("Qwen2 with per-layer sliding-window attention is not supported")
    return None


def model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else f"<none; model_type={raw.get('model_type')!r}>"
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    quantization = _quantization(raw.get("quantization_config"))  # refused by name, not as tensors
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
    num_heads = int(raw["num_attention_heads"])
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(
            f"num_attention_heads={num_heads} not a multiple of kv heads {num_kv_heads}"
        )
    hidden_size = int(raw["hidden_size"])
    rope_theta, rope_scaling = _rope(raw)
    eos = raw.get("eos_token_id")
    eos_token_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    bos = raw.get("bos_token_id")
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        # transformers drops keys equal to the class default (False for all three); the loader also
        # ties when the checkpoint has no lm_head.weight
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,  # Qwen2 always has q/k/v biases
        eos_token_ids=eos_token_ids,
        bos_token_id=None if bos is None else int(bos),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        o_proj_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=_sliding_window(raw, architecture),
        quantization=quantization,
    )


def load_model_config(path: Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint folder (or the file itself)."""
    file = path / "config.json" if path.is_dir() else path
    with open(file, encoding="utf-8") as f:
        return model_config_from_dict(json.load(f))
