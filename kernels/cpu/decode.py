"""One whole decoder layer of a decode-only step in C: the launcher. ``decode_f32.c`` (float32, an
AVX-512 and an AVX2 build), ``decode_bf16.c`` (bfloat16 weights and cache, AVX512-BF16) and
``decode_q.c`` (block-quantized linears, float32 otherwise: AVX512-VNNI and AVX2), all over the body
in ``decode_layer.h``.

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
# (dtype, isa) -> (source, prefix of its functions)
KERNELS = {
    (torch.float32, "avx512"): (HERE / "decode_f32.c", "decode_f32"),
    (torch.float32, "avx2"): (HERE / "decode_f32.c", "decode_f32"),
    (torch.bfloat16, "avx512_bf16"): (HERE / "decode_bf16.c", "decode_bf16"),
}
# isa -> source, for block-quantized linears (float32 norms, activations and cache)
QUANT_KERNELS = {"avx512_vnni": HERE / "decode_q.c", "avx2": HERE / "decode_q.c"}


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
        ("w_qkv", ctypes.c_void_p),  # the weight (float, bf16), or a QWeightArgs (decode_q.c)
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
    ]


class DecodeLayerKernel:
    """One (dtype, ISA) build, loaded."""

    def __init__(self, library: ctypes.CDLL, isa: str, dtype: torch.dtype, prefix: str) -> None:
        self.isa, self.dtype = isa, dtype
        self.quantized = False  # True: the linears' weights are QWeightArgs
        self.layer = getattr(library, f"{prefix}_layer")
        self.layer.argtypes = [ctypes.POINTER(LayerArgs), ctypes.POINTER(StepArgs)]
        self.layer.restype = None
        self._work_floats = getattr(library, f"{prefix}_work_floats")
        self._work_floats.argtypes = [ctypes.POINTER(LayerArgs), ctypes.c_int64]
        self._work_floats.restype = ctypes.c_int64
        self.max_head_dim = int(getattr(library, f"{prefix}_max_head_dim")())

    def work_floats(self, layer: LayerArgs, num_rows: int) -> int:
        """Scratch floats one call on ``num_rows`` rows needs (every layer of a model needs the same)."""
        return int(self._work_floats(ctypes.byref(layer), num_rows))


def load_decode_kernel(isa: str, cache_dir: Path, dtype: torch.dtype = torch.float32) -> DecodeLayerKernel:
    """Build (once per cache folder, dtype and ISA) and load; ``KernelBuildError`` without a C compiler."""
    if (dtype, isa) not in KERNELS:
        raise ValueError(f"isa: no {dtype} decode kernel for {isa!r}; there are {sorted(map(str, KERNELS))}")
    source, prefix = KERNELS[dtype, isa]
    return DecodeLayerKernel(load_library(source, cache_dir, isa), isa, dtype, prefix)


def load_quant_decode_kernel(isa: str, cache_dir: Path) -> DecodeLayerKernel:
    """The build for block-quantized linears (``decode_q.c``); ``KernelBuildError`` without a compiler."""
    if isa not in QUANT_KERNELS:
        raise ValueError(f"isa: no quantized decode kernel for {isa!r}; there are {sorted(QUANT_KERNELS)}")
    library = load_library(QUANT_KERNELS[isa], cache_dir, isa)
    kernel = DecodeLayerKernel(library, isa, torch.float32, "decode_q")
    kernel.quantized = True
    return kernel
