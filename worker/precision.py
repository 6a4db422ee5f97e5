"""The dtype an engine computes in: ``auto`` resolved from the device and the CPU probe, once.

``auto`` is bfloat16 on CUDA (float16 where the GPU has no bf16) and, on CPU, bfloat16 only where the
CPU computes bf16 natively (AVX-512-BF16, AMX); elsewhere every bf16 matmul converts to float32 and
back, which at batch 16 ran 2.6x slower than float32 on an AVX2 EPYC, so float32 is chosen there.
An explicit dtype is kept as given (bf16 on such a CPU works, with one warning that it is slow).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from worker.config import EngineConfig
from worker.cpu_isa import CpuCaps, probe
from worker.devices import resolve_device

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: str  # a key of worker.config.DTYPES
    reason: str
    warning: str | None = None  # a slow but working choice the user made


def choose_dtype(requested: str, device: str, caps: CpuCaps | None, cuda_bf16: bool = True) -> DtypeChoice:
    """``requested`` ("auto" or a dtype) on ``device``; ``caps`` is the CPU probe (unused on CUDA)."""
    if device.startswith("cuda"):
        if requested != "auto":
            return DtypeChoice(requested, "as configured")
        if cuda_bf16:
            return DtypeChoice("bfloat16", "auto: CUDA")
        return DtypeChoice("float16", "auto: CUDA without bfloat16 support")
    assert caps is not None, "a CPU device needs the CPU probe"
    if requested == "auto":
        if caps.native_bf16:
            return DtypeChoice("bfloat16", f"auto: the CPU computes bf16 natively ({caps.level.label})")
        level = caps.level.label
        return DtypeChoice("float32", f"auto: the CPU has no native bf16 ({level}), so bf16 would convert")
    if requested == "bfloat16" and not caps.native_bf16:
        return DtypeChoice(
            requested,
            "as configured",
            f"dtype bfloat16 on a CPU without native bf16 ({caps.level.label}): every matmul converts, "
            "which is slow here; dtype 'auto' would choose float32",
        )
    return DtypeChoice(requested, "as configured")


def resolve_dtype(config: EngineConfig) -> EngineConfig:
    """``config`` with a concrete dtype, the choice and its reason logged; unchanged if already concrete
    and nothing to warn about. A device of "auto" is resolved first (worker/devices.py)."""
    config = resolve_device(config)
    on_cuda = config.device.startswith("cuda")
    caps = None if on_cuda else probe()
    cuda_bf16 = on_cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    choice = choose_dtype(config.dtype, config.device, caps, cuda_bf16)
    if choice.warning:
        log.warning("%s", choice.warning)
    log.info("dtype: %s (%s)", choice.dtype, choice.reason)
    return dataclasses.replace(config, dtype=choice.dtype)
