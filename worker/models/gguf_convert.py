"""Turn a llama-architecture GGUF (as llama.cpp's converter writes it) into a Hugging Face Llama folder.

The result is what `LlamaForCausalLM.from_pretrained` reads: config.json, generation_config.json,
model.safetensors with HF tensor names, and the tokenizer files. Quantized tensors are dequantized,
so the folder reproduces the quantized model's weights exactly (in float32) rather than the original.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_PROGRESS_EVERY = 30  # tensors between counter lines: ~9 lines for a 272-tensor model

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(slots=True, frozen=True)
class LlamaSpec:
    """The shape and token facts a GGUF's `llama.*` / `tokenizer.ggml.*` metadata states."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    bos_token_id: int | None
    eos_token_id: int | None
    is_tied: bool


def convert_gguf_to_hf(
    gguf_path: Path,
    out_dir: Path,
    *,
    dtype: str = "float32",
    progress: Callable[[str], None] = print,
) -> None:
    """Write a Hugging Face Llama folder at `out_dir` from `gguf_path`, replacing any folder there.

    The folder is built beside `out_dir` and renamed into place at the end, so a crash never leaves
    a half-written folder under the final name.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    progress(f"reading {gguf_path}")
    reader = GGUFReader(gguf_path)
    spec = read_llama_spec(reader)

    def write_weights(staging: Path) -> None:
        tensors = _convert_tensors(reader, spec, _DTYPES[dtype], progress)
        progress(f"writing model.safetensors ({_num_bytes(tensors) / 1e6:.0f} MB, {dtype})")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})

    write_folder(gguf_path, spec, out_dir, dtype, write_weights, progress)
    progress(f"wrote {out_dir}")


def write_folder(
    gguf_path: Path,
    spec: LlamaSpec,
    out_dir: Path,
    dtype: str,
    write_weights: Callable[[Path], None],
    progress: Callable[[str], None],
) -> None:
    """Build a model folder for `gguf_path` beside `out_dir` (config, generation config, tokenizer,
    and whatever `write_weights` puts in it), then rename it into place, replacing any folder there:
    a crash never leaves a half-written folder under the final name."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        write_weights(staging)
        _write_json(staging / "config.json", _hf_config(spec, dtype))
        _write_json(staging / "generation_config.json", _generation_config(spec))
        progress("converting tokenizer")
        _write_tokenizer(gguf_path, staging, spec)
        _make_readable(staging)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def read_llama_spec(reader: GGUFReader) -> LlamaSpec:
    """The model's shape from the metadata; ValueError for any architecture but llama."""
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise ValueError(
            f"unsupported GGUF architecture {architecture!r}: only 'llama' models can be converted"
        )
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling != "none":
        # Our config would silently drop it and the model would attend wrongly past its trained length.
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r}: only unscaled rope is handled")
    tensor_names = {tensor.name for tensor in reader.tensors}
    hidden_size = int(_field(reader, "llama.embedding_length"))
    num_heads = int(_field(reader, "llama.attention.head_count"))
    # The embedding's row count is the vocabulary the weights serve, whatever the metadata says.
    vocab_size = int(_tensor(reader, "token_embd.weight").shape[-1])
    return LlamaSpec(
        num_layers=int(_field(reader, "llama.block_count")),
        hidden_size=hidden_size,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, "llama.attention.key_length", hidden_size // num_heads)),
        vocab_size=vocab_size,
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rope_theta=_from_f32(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_from_f32(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        bos_token_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id", None)),
        eos_token_id=_optional_int(_field(reader, "tokenizer.ggml.eos_token_id", None)),
        is_tied="output.weight" not in tensor_names,
    )


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of attn_q / attn_k.

    llama.cpp rotates interleaved pairs (x0,x1),(x2,x3)… while HF rotates halves (x_i, x_{i+d/2}),
    so its converter reorders each head's rows from [half0 | half1] to [h0_0,h1_0,h0_1,h1_1,…]:
    `w.reshape(n_head, 2, d // 2, …).swapaxes(1, 2)`. The inverse swaps the same axes back.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    shaped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(shaped.swapaxes(1, 2).reshape(weight.shape))


def hf_tensor_name(gguf_name: str) -> str:
    """The HF Llama name for a llama.cpp tensor name; ValueError for one we do not know."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for a llama model")


def _convert_tensors(
    reader: GGUFReader, spec: LlamaSpec, dtype: torch.dtype, progress: Callable[[str], None]
) -> dict[str, torch.Tensor]:
    num_tensors = len(reader.tensors)
    progress(f"dequantizing {num_tensors} tensors")
    tensors: dict[str, torch.Tensor] = {}
    for index, tensor in enumerate(reader.tensors, start=1):
        name = hf_tensor_name(tensor.name)
        # GGUF lists dims innermost first (ne0 = columns); torch wants them outermost first.
        shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, spec.num_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, spec.num_kv_heads)
        # torch.tensor copies: the reader's arrays are read-only views of a memory-mapped file.
        tensors[name] = torch.tensor(weight, dtype=torch.float32).to(dtype)
        if index % _PROGRESS_EVERY == 0 or index == num_tensors:
            progress(f"dequantized {index}/{num_tensors} tensors")
    return tensors


def _hf_config(spec: LlamaSpec, dtype: str) -> dict[str, Any]:
    # rope_theta is written both top level (transformers 4 and plain readers) and inside
    # rope_parameters (where transformers 5 keeps it), so every reader agrees on it.
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": spec.is_tied,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": spec.eos_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def _generation_config(spec: LlamaSpec) -> dict[str, Any]:
    return {"bos_token_id": spec.bos_token_id, "eos_token_id": spec.eos_token_id}


def _write_tokenizer(gguf_path: Path, out_dir: Path, spec: LlamaSpec) -> None:
    # transformers already rebuilds a fast tokenizer (vocab, merges, special tokens, chat template)
    # from GGUF metadata; imported here so reading shapes does not pay for it.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # Left alone it says 1e30, which hides the real context limit from anyone reading the folder.
    tokenizer.model_max_length = spec.max_position_embeddings
    tokenizer.save_pretrained(str(out_dir))


def _make_readable(folder: Path) -> None:
    # mkdtemp makes the folder owner-only (and safetensors its file); a model cache is often
    # filled by one user and served by another, so give it ordinary permissions.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Rename `staging` to `out_dir`; an old `out_dir` is moved aside first, then deleted."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    retired = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    out_dir.rename(retired)
    staging.rename(out_dir)
    shutil.rmtree(retired, ignore_errors=True)


def _field(reader: GGUFReader, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ValueError(f"GGUF metadata lacks required key {key!r}")
        return default
    return field.contents()


def _tensor(reader: GGUFReader, name: str) -> Any:
    for tensor in reader.tensors:
        if tensor.name == name:
            return tensor
    raise ValueError(f"GGUF lacks tensor {name!r}")


def _from_f32(value: float) -> float:
    # GGUF stores these as float32: 1e-5 reads back as 9.99999974e-06. Seven significant digits
    # recover the value the model's authors wrote.
    return float(f"{float(value):.7g}")


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _num_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
