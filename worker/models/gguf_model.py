"""A llama GGUF file served from its blocks: Q8_0 / Q4_0 / Q4_1 as they are, Q4_K / Q5_0 / Q5_1 / Q5_K
rewritten exactly into those kinds, Q6_K requantized to Q8_0 (``kernels/gguf_types.py``); none of it
dequantized to float.

A pool (or ``--model``) may name a ``.gguf`` file. :func:`prepare_gguf_folder` gives it a small folder
under the model cache, once per file (keyed by its path, size and mtime): ``config.json``,
``generation_config.json`` and the tokenizer from the file's metadata (as ``models pull`` writes
them), and ``gguf.json`` naming the file, in place of ``model.safetensors``. Everything that reads a
model folder (the tokenizer, the prompt builder, the worker's ``--model``) then reads this one, and
:func:`load_gguf_model` builds the model from the file: quantized linears as
:class:`~worker.models.quant.QuantLinear` (q/k rows un-permuted as ``gguf_convert`` does, blocks
whole), float tensors as they are, a quantized token embedding kept quantized (the tied lm_head reads
the same blocks). A fused projection whose parts differ in type (a Q4_K_M file's Q4_K q/k beside a
Q6_K v) is widened to one 8-bit kind, values unchanged. Other types (Q2_K, Q3_K, IQ*, ...) are
refused, naming the tensor and type.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from gguf import GGUFReader
from torch import nn

from kernels.gguf_types import SERVED_TYPES, from_gguf
from kernels.quant_format import QuantizedWeight, UnsupportedQuantError
from worker.attention import AttentionBackend, TorchPagedAttention
from worker.models.config import ModelConfig, load_model_config
from worker.models.gguf_convert import read_llama_spec, unpermute_qk, write_folder
from worker.models.llama import DecoderLayer, LlamaForCausalLM
from worker.models.quant import QuantEmbedding, QuantLinear, move_quantized

log = logging.getLogger(__name__)

POINTER = "gguf.json"  # in a prepared folder: which file its weights are read from
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def is_gguf_folder(folder: Path) -> bool:
    return (folder / POINTER).is_file()


def _identity(gguf_path: Path) -> dict[str, Any]:
    stat = gguf_path.stat()
    return {"gguf": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def gguf_folder_for(gguf_path: Path, root: Path) -> Path:
    """Where ``gguf_path``'s folder is (or will be) under the model cache ``root``."""
    key = hashlib.sha256(json.dumps(_identity(gguf_path), sort_keys=True).encode()).hexdigest()[:12]
    return root / "gguf" / f"{gguf_path.stem}-{key}"


def prepare_gguf_folder(gguf_path: Path, root: Path, progress: Callable[[str], None] = log.info) -> Path:
    """The folder for ``gguf_path``, written on first use (a few seconds: the tokenizer's conversion)."""
    folder = gguf_folder_for(gguf_path, root)
    if is_gguf_folder(folder):
        return folder
    progress(f"reading {gguf_path}")
    spec = read_llama_spec(GGUFReader(gguf_path))

    def write_pointer(staging: Path) -> None:
        (staging / POINTER).write_text(json.dumps(_identity(gguf_path), indent=2) + "\n")

    write_folder(gguf_path, spec, folder, "float32", write_pointer, progress)
    progress(f"{gguf_path.name}: served from its own blocks; metadata in {folder}")
    return folder


def load_gguf_model(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attention: AttentionBackend | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model of a prepared folder's GGUF, in eval mode, on ``device``; its linears run the kernels'
    torch reference until ``use_quant_kernels`` (CPU) or ``use_triton_quant_kernels`` binds a kernel."""
    pointer = json.loads((folder / POINTER).read_text())
    gguf_path = Path(pointer["gguf"])
    if not gguf_path.is_file() or _identity(gguf_path) != pointer:
        raise FileNotFoundError(f"{folder} was prepared from {gguf_path}, which is gone or has changed")
    config = load_model_config(folder)
    reader = GGUFReader(gguf_path)
    spec = read_llama_spec(reader)
    tensors = {t.name: t for t in reader.tensors}
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention or TorchPagedAttention())
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer, module)
        blk = f"blk.{i}"
        q, k, v = (tensors[f"{blk}.attn_{p}.weight"] for p in "qkv")
        gate, up = tensors[f"{blk}.ffn_gate.weight"], tensors[f"{blk}.ffn_up.weight"]
        projections: dict[str, list[tuple[Any, int | None]]] = {
            "qkv_proj": [(q, spec.num_heads), (k, spec.num_kv_heads), (v, None)],
            "o_proj": [(tensors[f"{blk}.attn_output.weight"], None)],
            "gate_up_proj": [(gate, None), (up, None)],
            "down_proj": [(tensors[f"{blk}.ffn_down.weight"], None)],
        }
        for name, parts in projections.items():  # a QuantLinear where the model built an nn.Linear
            setattr(layer, name, _linear(parts, dtype))
        layer.input_layernorm.weight = _parameter(tensors[f"{blk}.attn_norm.weight"], dtype)
        layer.post_attention_layernorm.weight = _parameter(tensors[f"{blk}.ffn_norm.weight"], dtype)
    model.norm.weight = _parameter(tensors["output_norm.weight"], dtype)
    embedding = tensors["token_embd.weight"]
    if _is_float(embedding):
        model.embed_tokens = nn.Embedding.from_pretrained(_float(embedding, dtype), freeze=True)
    else:
        quantized = _quantized(embedding, None)
        # the model only calls it; its .weight is read by the tied logits, and lm_head is set here
        model.embed_tokens = QuantEmbedding(quantized, dtype)  # type: ignore[assignment]
        if "output.weight" not in tensors:  # tied: the logits read the embedding's blocks
            model.lm_head = QuantLinear(quantized, None)
    if "output.weight" in tensors:
        model.lm_head = _linear([(tensors["output.weight"], None)], dtype)
    if torch.device(device).type != "cpu":  # built on the CPU (blocks read from the file), then moved
        model.to(device)
        move_quantized(model, device)
    model.build_rope_cache(device, dtype)
    model.eval().requires_grad_(False)
    log.info("%s: %s", gguf_path.name, describe(reader))
    return model, config


def describe(reader: GGUFReader) -> str:
    """The tensor types of a GGUF file, e.g. "210 q4_1, 61 f32, 1 q8_0 tensors"."""
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        name = tensor.tensor_type.name.lower()
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {t}" for t, n in sorted(counts.items(), key=lambda kv: -kv[1])) + " tensors"


def _is_float(tensor: Any) -> bool:
    """True for a float tensor, False for a quantized one the kernels serve; refuses the rest."""
    name = tensor.tensor_type.name
    if name in _FLOAT_TYPES:
        return True
    if name not in SERVED_TYPES:
        raise UnsupportedQuantError(
            f"GGUF tensor {tensor.name!r} is {name}: served are {', '.join(SERVED_TYPES)} (and "
            "F32/F16/BF16); `tierserve models pull`-style conversion to a float folder serves any type"
        )
    return False


def _shape(tensor: Any) -> tuple[int, int]:
    cols, rows = (int(d) for d in tensor.shape.tolist())  # GGUF lists the innermost dimension first
    return rows, cols


def _quantized(tensor: Any, num_heads: int | None) -> QuantizedWeight:
    raw = np.asarray(tensor.data)
    if num_heads is not None:  # llama.cpp's q/k row order undone, whole rows of blocks at a time
        raw = unpermute_qk(raw, num_heads)
    type_name = tensor.tensor_type.name
    _is_float(tensor)  # refuses a type not served, naming the tensor
    converted = from_gguf(type_name, raw, _shape(tensor))
    if converted.requantized:
        log.info(
            "%s: %s requantized to %s (finer blocks than it has)",
            tensor.name,
            type_name,
            converted.weight.kind.upper(),
        )
    return converted.weight


def _float(tensor: Any, dtype: torch.dtype, num_heads: int | None = None) -> torch.Tensor:
    data = np.asarray(tensor.data)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    weight = data.reshape(shape)
    if num_heads is not None:
        weight = unpermute_qk(weight, num_heads)
    return torch.tensor(np.ascontiguousarray(weight)).to(dtype)  # copies out of the memory map


def _parameter(tensor: Any, dtype: torch.dtype) -> nn.Parameter:
    if not _is_float(tensor):
        raise UnsupportedQuantError(f"GGUF tensor {tensor.name!r}: a norm weight must be float")
    return nn.Parameter(_float(tensor, dtype), requires_grad=False)


def _linear(parts: list[tuple[Any, int | None]], dtype: torch.dtype) -> nn.Module:
    """One (fused) projection from GGUF tensors whose rows stack: quantized if they all are (of mixed
    types: widened to one, ``QuantizedWeight.cat``), float if none is."""
    floats = {_is_float(t) for t, _ in parts}
    if floats == {True}:
        weight = torch.cat([_float(t, dtype, heads) for t, heads in parts])
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        return linear
    if len(floats) > 1:
        names = ", ".join(f"{t.name} ({t.tensor_type.name})" for t, _ in parts)
        raise UnsupportedQuantError(f"a fused projection mixes float and quantized tensors: {names}")
    return QuantLinear(QuantizedWeight.cat([_quantized(t, heads) for t, heads in parts]), None)
