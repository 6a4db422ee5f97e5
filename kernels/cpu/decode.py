"""One whole decoder layer of a float32 decode-only step in C (``decode_f32.c``): the launcher.

The torch reference is the model's own layer (``worker.models.llama.DecoderLayer`` over
``TorchPagedAttention``): the tests run both on the same weights and cache. ``LayerArgs`` holds what
stays fixed for a layer (shapes, weight and cache pointers), built once; ``StepArgs`` what changes per
step, filled once per step and shared by every layer's call.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from kernels.cpu.build import load_library

SOURCE = Path(__file__).with_name("decode_f32.c")
ISAS = ("avx512", "avx2")


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
        ("w_qkv", ctypes.c_void_p),
        ("b_qkv", ctypes.c_void_p),
        ("w_o", ctypes.c_void_p),
        ("b_o", ctypes.c_void_p),
        ("w_gate_up", ctypes.c_void_p),
        ("b_gate_up", ctypes.c_void_p),
        ("w_down", ctypes.c_void_p),
        ("b_down", ctypes.c_void_p),
        ("kv", ctypes.c_void_p),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
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
    """One ISA's build of decode_f32.c, loaded."""

    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        self.isa = isa
        self.layer = library.decode_f32_layer
        self.layer.argtypes = [ctypes.POINTER(LayerArgs), ctypes.POINTER(StepArgs)]
        self.layer.restype = None
        self._work_floats = library.decode_f32_work_floats
        self._work_floats.argtypes = [ctypes.POINTER(LayerArgs), ctypes.c_int64]
        self._work_floats.restype = ctypes.c_int64
        self.max_head_dim = int(library.decode_f32_max_head_dim())

    def work_floats(self, layer: LayerArgs, num_rows: int) -> int:
        """Scratch floats one call on ``num_rows`` rows needs (every layer of a model needs the same)."""
        return int(self._work_floats(ctypes.byref(layer), num_rows))


def load_decode_kernel(isa: str, cache_dir: Path) -> DecodeLayerKernel:
    """Build (once per cache folder and ISA) and load; ``KernelBuildError`` without a C compiler."""
    if isa not in ISAS:
        raise ValueError(f"isa: expected one of {ISAS}, got {isa!r}")
    return DecodeLayerKernel(load_library(SOURCE, cache_dir, isa), isa)
