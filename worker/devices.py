"""Which device a worker computes on, and what it is: ``auto`` resolved once, GPUs counted, named.

    device "auto"  →  "cuda" when torch sees a CUDA device, else "cpu"      (logged once)

A worker serve starts on a GPU box sees one GPU (``CUDA_VISIBLE_DEVICES``, set per worker by the
composition root, ``tierserve/worker_plan.py``), so its "cuda" is that GPU. Torch is imported lazily:
serve counts GPUs through :func:`count_visible_gpus` without paying for torch when no pool needs it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.cpu_isa import read_cpuinfo

if TYPE_CHECKING:
    import torch

    from worker.config import EngineConfig

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda")  # and "cuda:N"


def is_cuda_device(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def check_device(device: str) -> str:
    """``device`` if it is auto, cpu, cuda or cuda:N; ``ValueError`` naming the choices otherwise."""
    if device in DEVICE_CHOICES or (device.startswith("cuda:") and device[5:].isdigit()):
        return device
    raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {device!r}")


def choose_device(requested: str, cuda_available: bool) -> str:
    """``requested`` with "auto" made concrete: cuda where there is one, else cpu."""
    if requested != "auto":
        return requested
    return "cuda" if cuda_available else "cpu"


def resolve_device(config: EngineConfig) -> EngineConfig:
    """``config`` with a concrete device (the choice logged); unchanged when it is concrete already."""
    if config.device != "auto":
        return config
    import torch

    device = choose_device("auto", torch.cuda.is_available())
    log.info("device: %s (auto: %s)", device, "a CUDA device is visible" if device == "cuda" else "no CUDA")
    return dataclasses.replace(config, device=device)


def count_visible_gpus() -> int:
    """CUDA devices this process sees (``CUDA_VISIBLE_DEVICES`` applied); 0 without CUDA or torch's."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What a worker tells the gateway about its device (``Register``)."""

    name: str | None  # "NVIDIA H100 80GB HBM3", or the CPU's model name
    memory_bytes: int | None  # a GPU's total memory; None on CPU (its KV cache is sized by kv_cache_gb)


def describe_device(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        return DeviceInfo(props.name, int(props.total_memory))
    if device.type == "cpu":
        model_name, _ = read_cpuinfo()
        return DeviceInfo(model_name, None)
    return DeviceInfo(None, None)
