"""Each row's argmax on CPU, the greedy sampler's hot path: ``argmax.c``'s launcher. The spec is
``argmax_reference``, torch's ``max(dim=-1).indices`` (the first maximal index; a NaN counts as maximal).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import load_library

SOURCE = Path(__file__).parent / "argmax.c"


def argmax_reference(scores: torch.Tensor) -> torch.Tensor:
    return scores.max(dim=-1).indices


class RowArgmax:
    """``argmax_reference`` by the C kernel for contiguous float32 ``[M, N]`` CPU scores (N > 0), by
    the reference for anything else (which raises as it does, e.g. for an empty row)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.argmax_rows_f32
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
        self._fn.restype = None

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        if (
            scores.dtype != torch.float32
            or scores.device.type != "cpu"
            or scores.dim() != 2
            or scores.shape[1] == 0
            or not scores.is_contiguous()
        ):
            return argmax_reference(scores)
        num_rows, num_cols = scores.shape
        out = torch.empty(num_rows, dtype=torch.int64)
        self._fn(scores.data_ptr(), num_rows, num_cols, torch.get_num_threads(), out.data_ptr())
        return out


def load_argmax_kernel(cache_dir: Path) -> RowArgmax:
    """Build (once per cache folder) and load the kernel; ``KernelBuildError`` without a working C
    compiler. No ISA target: it runs on every x86-64 CPU."""
    return RowArgmax(load_library(SOURCE, cache_dir))
