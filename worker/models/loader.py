"""Load a Hugging Face safetensors checkpoint (one file or shards) into ``LlamaForCausalLM``.

HF names map onto ours by dropping the ``model.`` prefix and fusing projections::

    model.layers.N.self_attn.{q,k,v}_proj.{weight,bias}  -> layers.N.qkv_proj.*      (rows: q | k | v)
    model.layers.N.mlp.{gate,up}_proj.{weight,bias}      -> layers.N.gate_up_proj.*  (rows: gate | up)
    model.layers.N.self_attn.o_proj.*                    -> layers.N.o_proj.*
    model.layers.N.mlp.down_proj.*                       -> layers.N.down_proj.*
    model.{embed_tokens,norm}.weight, lm_head.weight     -> same without "model."

The model is built on the meta device and its parameters are assigned the loaded tensors, so no
memory is spent on (or time spent in) random initialisation that would be overwritten. A GPTQ / AWQ
checkpoint (``quantization_config``) has its four projections per layer built by ``hf_quant.py`` from
the same names' ``qweight`` / ``qzeros`` / ``scales``; everything else comes through this path.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from worker.attention import AttentionBackend, TorchPagedAttention
from worker.models.config import ModelConfig, WeightMismatchError, load_model_config
from worker.models.gguf_model import is_gguf_folder, load_gguf_model
from worker.models.hf_quant import install_quant_projections
from worker.models.llama import LlamaForCausalLM

# Buffers some older checkpoints saved that carry no information we need.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_SINGLE = {
    "o_proj": "self_attn.o_proj",
    "down_proj": "mlp.down_proj",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
}

__all__ = ["WeightMismatchError", "load_model"]  # the error is config.py's, raised from here too


def _sources(name: str) -> list[str]:
    """HF tensor names whose rows, concatenated, make our parameter ``name``."""
    if not name.startswith("layers."):
        return [name if name == "lm_head.weight" else f"model.{name}"]
    _, index, module, kind = name.split(".")
    prefix = f"model.layers.{index}"
    if module in _FUSED:
        return [f"{prefix}.{part}.{kind}" for part in _FUSED[module]]
    return [f"{prefix}.{_SINGLE[module]}.{kind}"]


def _projection_sources(num_layers: int) -> dict[str, list[str]]:
    """Our projection modules -> the HF module prefixes whose rows they stack."""
    return {
        f"layers.{i}.{module}": [s.removesuffix(".weight") for s in _sources(f"layers.{i}.{module}.weight")]
        for i in range(num_layers)
        for module in _PROJECTIONS
    }


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attention: AttentionBackend | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Read ``config.json`` and every ``*.safetensors`` under ``path``; returns the model in eval mode.

    The returned config has ``tie_word_embeddings=True`` when the checkpoint has no ``lm_head.weight``.
    A folder prepared for a GGUF file (``gguf_model.py``) is loaded from that file, quantized blocks kept.
    Raises ``UnsupportedModelError`` for an architecture we lack, ``WeightMismatchError`` naming any
    missing, unexpected or misshapen tensor.
    """
    path = Path(path)
    if is_gguf_folder(path):  # a GGUF file's folder: the weights come from the file, blocks kept
        return load_gguf_model(path, dtype, device, attention)
    config = load_model_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    with ExitStack() as stack:
        handles: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            handles |= dict.fromkeys(handle.keys(), handle)
        if "lm_head.weight" not in handles and not config.tie_word_embeddings:
            config = dataclasses.replace(config, tie_word_embeddings=True)
        with torch.device("meta"):
            model = LlamaForCausalLM(config, attention or TorchPagedAttention())
        used: set[str] = set()
        missing: list[str] = []
        quantized: dict[str, list[str]] = {}
        if config.quantization is not None:  # the projections from GPTQ / AWQ tensors, as q4_1 blocks
            quantized = _projection_sources(config.num_layers)
            used, missing = install_quant_projections(model, config.quantization, quantized, handles, device)
        state = model.state_dict()
        loaded: dict[str, torch.Tensor] = {}
        for name, meta_param in state.items():
            if name.rpartition(".")[0] in quantized:  # built above (its bias with it), or missing
                loaded[name] = meta_param
                continue
            sources = _sources(name)
            missing += [s for s in sources if s not in handles]
            if any(s not in handles for s in sources):
                continue
            used.update(sources)
            loaded[name] = _materialise(name, sources, handles, meta_param.shape, dtype, device)
        if config.tie_word_embeddings:
            used.add("lm_head.weight")  # a tied checkpoint may still carry a copy; the embedding wins
        unexpected = sorted(n for n in handles if n not in used and not _IGNORED.fullmatch(n))
        if missing or unexpected:
            raise WeightMismatchError(
                f"checkpoint {path} does not match its config ({config.architecture}): "
                f"missing {missing or 'none'}; unexpected {unexpected or 'none'}"
            )
    model.load_state_dict(loaded, strict=True, assign=True)
    model.build_rope_cache(device, dtype)
    model.eval().requires_grad_(False)
    return model, config


def _materialise(
    name: str,
    sources: list[str],
    handles: dict[str, Any],
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Copy the source tensors (rows concatenated) into one new tensor of ``dtype`` on ``device``."""
    out = torch.empty(shape, dtype=dtype, device=device)
    row = 0
    for source in sources:
        tensor = handles[source].get_tensor(source)
        rows = tensor.shape[0]
        if tuple(tensor.shape[1:]) != tuple(shape[1:]) or row + rows > shape[0]:
            raise WeightMismatchError(
                f"{source} has shape {tuple(tensor.shape)}; {name} expects {tuple(shape)}"
            )
        out[row : row + rows].copy_(tensor)  # copy_ converts dtype and moves device in one pass
        row += rows
    if row != shape[0]:
        raise WeightMismatchError(f"{' + '.join(sources)} give {row} rows; {name} expects {shape[0]}")
    return out
