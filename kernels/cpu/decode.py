"""One whole decoder layer of a decode-only step in C: the launcher. ``decode_f32.c`` (float32, an
AVX-512 and an AVX2 build), ``decode_bf16.c`` (bfloat16 weights and cache, AVX512-BF16) and
``decode_q.c`` (block-quantized linears, float32 otherwise: AVX512-VNNI and AVX2), all over the body
in ``decode_layer.h``; ``decode_f32_kv16.c`` and ``decode_q_kv16.c`` are the float32 and quantized
builds over a bfloat16 KV cache (``kv16.h``).

The torch reference is the model's own layer (``worker.models.llama.DecoderLayer`` over
``TorchPagedAttention``): the tests run both on the same weights and cache. ``LayerArgs`` holds what
stays fixed for a layer (shapes, weight and cache pointers), built once; ``StepArgs`` what changes per
step, filled once per step and shared by every layer's call.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import load_library

HERE = Path(__file__).parent
# (weights' dtype, KV cache's dtype, isa) -> (source, prefix of its functions)
KERNELS = {
    (torch.float32, torch.float32, "avx512"): (HERE / "decode_f32.c", "decode_f32"),
    (torch.float32, torch.float32, "avx2"): (HERE / "decode_f32.c", "decode_f32"),
    (torch.float32, torch.bfloat16, "avx512"): (HERE / "decode_f32_kv16.c", "decode_f32_kv16"),
    (torch.float32, torch.bfloat16, "avx2"): (HERE / "decode_f32_kv16.c", "decode_f32_kv16"),
    (torch.bfloat16, torch.bfloat16, "avx512_bf16"): (HERE / "decode_bf16.c", "decode_bf16"),
}
# (KV cache's dtype, isa) -> (source, prefix), for block-quantized linears (float32 norms, activations)
QUANT_KERNELS = {
    (torch.float32, "avx512_vnni"): (HERE / "decode_q.c", "decode_q"),
    (torch.float32, "avx2"): (HERE / "decode_q.c", "decode_q"),
    (torch.bfloat16, "avx512_vnni"): (HERE / "decode_q_kv16.c", "decode_q_kv16"),
    (torch.bfloat16, "avx2"): (HERE / "decode_q_kv16.c", "decode_q_kv16"),
}


class LayerArgs(ctypes.Structure):
    """``Layer`` in decode_f32.c. Pointers are raw addresses: whoever builds one keeps the tensors."""

    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("ln1", ctypes.c_void_p),
        ("ln2", ctypes.c_void_p),
        # the weight (float32: packed, linear.pack_weight; bf16 as is), or a QWeightArgs (decode_q.c)
        ("w_qkv", ctypes.c_void_p),
        ("w_o", ctypes.c_void_p),
        ("w_gate_up", ctypes.c_void_p),
        ("w_down", ctypes.c_void_p),
        ("b_qkv", ctypes.c_void_p),
        ("b_o", ctypes.c_void_p),
        ("b_gate_up", ctypes.c_void_p),
        ("b_down", ctypes.c_void_p),
        ("kv", ctypes.c_void_p),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
    ]


class QWeightArgs(ctypes.Structure):
    """``QWeight`` in decode_q.c: a packed block-quantized weight (``kernels/cpu/qlinear.py``)."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("bits", ctypes.c_int64),
        ("qs", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("c", ctypes.c_void_p),
    ]


class StepArgs(ctypes.Structure):
    """``Step`` in decode_f32.c."""

    _fields_ = [
        ("num_rows", ctypes.c_int64),
        ("hidden", ctypes.c_void_p),
        ("residual", ctypes.c_void_p),
        ("first", ctypes.c_int64),
        ("cos_sin", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("table_width", ctypes.c_int64),
        ("seq_lens", ctypes.c_void_p),
        ("sliding_window", ctypes.c_int64),
        ("work", ctypes.c_void_p),
        ("num_threads", ctypes.c_int64),
        ("unit_starts", ctypes.c_void_p),  # DecodeLayerKernel.attention_units fills both
        ("num_units", ctypes.c_int64),
        ("in_prompt", ctypes.c_void_p),  # uint8 [num_rows]: 1 a prompt's token, 0 an output token
    ]


class DecodeLayerKernel:
    """One (dtype, KV dtype, ISA) build, loaded."""

    def __init__(
        self, library: ctypes.CDLL, isa: str, dtype: torch.dtype, prefix: str, kv_dtype: torch.dtype
    ) -> None:
        self.isa, self.dtype, self.kv_dtype = isa, dtype, kv_dtype
        self.quantized = False  # True: the linears' weights are QWeightArgs
        self.layer = getattr(library, f"{prefix}_layer")
        self.layer.argtypes = [ctypes.POINTER(LayerArgs), ctypes.POINTER(StepArgs)]
        self.layer.restype = None
        self._work_floats = getattr(library, f"{prefix}_work_floats")
        self._work_floats.argtypes = [ctypes.POINTER(LayerArgs), ctypes.c_int64]
        self._work_floats.restype = ctypes.c_int64
        self._units = getattr(library, f"{prefix}_attention_units")
        self._units.argtypes = [ctypes.POINTER(LayerArgs), ctypes.POINTER(StepArgs), ctypes.c_void_p]
        self._units.restype = ctypes.c_int64
        self.max_head_dim = int(getattr(library, f"{prefix}_max_head_dim")())
        # Rows a float32 build's linears take in one pass over the weights (linear_f32.c's ROW_BLOCK,
        # which the float32 builds include); None for the others.
        row_block = getattr(library, "linear_f32_row_block", None)
        if row_block is not None:
            row_block.restype = ctypes.c_int64
        self.row_block: int | None = int(row_block()) if row_block is not None else None

    def work_floats(self, layer: LayerArgs, num_rows: int) -> int:
        """Scratch floats one call on ``num_rows`` rows needs (every layer of a model needs the same)."""
        return int(self._work_floats(ctypes.byref(layer), num_rows))

    def attention_units(self, layer: LayerArgs, step: StepArgs, starts: torch.Tensor) -> None:
        """Fill ``step``'s attention units (tiles of a prompt's consecutive rows, single rows), the same
        for every layer of the step: once a step, before the first layer's call. ``starts``: int64, at
        least ``step.num_rows + 1`` values, kept by the caller while it calls ``layer`` (the step
        points into it)."""
        if starts.dtype != torch.int64 or starts.numel() <= step.num_rows or not starts.is_contiguous():
            raise ValueError(f"starts: expected {step.num_rows + 1} contiguous int64 values")
        step.num_units = int(self._units(ctypes.byref(layer), ctypes.byref(step), starts.data_ptr()))
        step.unit_starts = starts.data_ptr()


def load_decode_kernel(
    isa: str, cache_dir: Path, dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None
) -> DecodeLayerKernel:
    """Build (once per cache folder, dtypes and ISA) and load; ``KernelBuildError`` without a C compiler.
    ``kv_dtype`` None: the weights' dtype."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if (dtype, kv_dtype, isa) not in KERNELS:
        there = sorted(f"{w} weights, {kv} cache, {i}" for w, kv, i in KERNELS)
        raise ValueError(
            f"no decode kernel for {dtype} weights, a {kv_dtype} cache, {isa!r}; there are {there}"
        )
    source, prefix = KERNELS[dtype, kv_dtype, isa]
    return DecodeLayerKernel(load_library(source, cache_dir, isa), isa, dtype, prefix, kv_dtype)


def load_quant_decode_kernel(
    isa: str, cache_dir: Path, kv_dtype: torch.dtype = torch.float32
) -> DecodeLayerKernel:
    """The build for block-quantized linears (``decode_q.c``, or ``decode_q_kv16.c`` over a bfloat16
    cache); ``KernelBuildError`` without a compiler."""
    if (kv_dtype, isa) not in QUANT_KERNELS:
        there = sorted(f"{kv} cache, {i}" for kv, i in QUANT_KERNELS)
        raise ValueError(f"no quantized decode kernel for a {kv_dtype} cache, {isa!r}; there are {there}")
    source, prefix = QUANT_KERNELS[kv_dtype, isa]
    kernel = DecodeLayerKernel(load_library(source, cache_dir, isa), isa, torch.float32, prefix, kv_dtype)
    kernel.quantized = True
    return kernel
