"""The sampler's row operations in C on CPU: ``sampling.c``'s launcher. The references and the rules are
``kernels/sampling.py``'s (``TORCH_SAMPLING``), which also take what the kernels do not: anything but
contiguous float32 ``[M, N]`` CPU rows with N > 0.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import load_library
from kernels.sampling import TORCH_SAMPLING

SOURCE = Path(__file__).parent / "sampling.c"


def _takes(x: torch.Tensor) -> bool:
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[1] > 0
        and x.is_contiguous()
    )


class CpuSamplingOps:
    """A ``kernels.sampling.SamplingOps`` by the C kernels."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._argmax = library.argmax_rows_f32
        self._argmax.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self._argmax.restype = None
        self._cut = library.cut_rows_f32
        pointer, size, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._cut.argtypes = [pointer, pointer, size, size, pointer, pointer, flag, flag, pointer, pointer]
        self._cut.restype = None
        self._scratch = torch.empty(0)  # 2 x vocabulary floats a thread, kept between calls
        self._race = library.race_rows_f32
        self._race.argtypes = [pointer, size, size, pointer, flag, pointer]
        self._race.restype = None

    def argmax(self, scores: torch.Tensor) -> torch.Tensor:
        if not _takes(scores):
            return TORCH_SAMPLING.argmax(scores)
        num_rows, num_cols = scores.shape
        out = torch.empty(num_rows, dtype=torch.int64)
        self._argmax(scores.data_ptr(), num_rows, num_cols, torch.get_num_threads(), out.data_ptr())
        return out

    def thresholds(
        self, logits: torch.Tensor, weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
    ) -> torch.Tensor:
        if not self._fits(logits, weights):
            return TORCH_SAMPLING.thresholds(logits, weights, top_k, top_p)
        return self._run(logits, weights, top_k, top_p, drop=False)

    def truncate(
        self, logits: torch.Tensor, weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
    ) -> None:
        if not self._fits(logits, weights):
            TORCH_SAMPLING.truncate(logits, weights, top_k, top_p)
            return
        self._run(logits, weights, top_k, top_p, drop=True)

    def race(self, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        if not _takes(weights):
            return TORCH_SAMPLING.race(weights, keys)
        num_rows, num_cols = weights.shape
        k = keys.to(device="cpu", dtype=torch.int64).contiguous()
        if k.shape != (num_rows,):
            raise ValueError(f"keys: expected [{num_rows}], got {tuple(k.shape)}")
        out = torch.empty(num_rows, dtype=torch.int64)
        self._race(
            weights.data_ptr(), num_rows, num_cols, k.data_ptr(), torch.get_num_threads(), out.data_ptr()
        )
        return out

    @staticmethod
    def _fits(logits: torch.Tensor, weights: torch.Tensor) -> bool:
        return _takes(logits) and _takes(weights) and weights.shape == logits.shape

    def _run(
        self,
        logits: torch.Tensor,
        weights: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        drop: bool,
    ) -> torch.Tensor:
        num_rows, num_cols = logits.shape
        k = top_k.to(device="cpu", dtype=torch.int64).contiguous()
        p = top_p.to(device="cpu", dtype=torch.float32).contiguous()
        if k.shape != (num_rows,) or p.shape != (num_rows,):
            raise ValueError(f"top_k, top_p: expected [{num_rows}], got {tuple(k.shape)}, {tuple(p.shape)}")
        threads = torch.get_num_threads()
        if self._scratch.numel() < threads * 2 * num_cols:
            self._scratch = torch.empty(threads * 2 * num_cols, dtype=torch.float32)
        out = torch.empty(num_rows, dtype=torch.float32)
        pointers = (logits.data_ptr(), weights.data_ptr(), num_rows, num_cols, k.data_ptr(), p.data_ptr())
        self._cut(*pointers, int(drop), threads, self._scratch.data_ptr(), out.data_ptr())
        return out


def load_sampling_kernels(cache_dir: Path) -> CpuSamplingOps:
    """Build (once per cache folder) and load the kernels; ``KernelBuildError`` without a working C
    compiler. No ISA target: they run on every x86-64 CPU."""
    return CpuSamplingOps(load_library(SOURCE, cache_dir))
