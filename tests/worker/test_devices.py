"""Device selection: ``auto`` resolves to cuda only where torch sees one; what a worker tells the gateway."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from worker.config import EngineConfig
from worker.cpu_isa import read_cpuinfo
from worker.devices import (
    check_device,
    choose_device,
    count_visible_gpus,
    describe_device,
    is_cuda_device,
    resolve_device,
)


def test_auto_is_cuda_only_where_there_is_one() -> None:
    assert choose_device("auto", cuda_available=True) == "cuda"
    assert choose_device("auto", cuda_available=False) == "cpu"
    assert choose_device("cpu", cuda_available=True) == "cpu"  # an explicit choice is kept
    assert choose_device("cuda:1", cuda_available=False) == "cuda:1"


def test_the_default_device_is_auto_and_resolves_on_this_machine() -> None:
    config = EngineConfig()
    assert config.device == "auto"
    resolved = resolve_device(config)
    assert resolved.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(resolved) is resolved  # once: a concrete device is left alone
    assert count_visible_gpus() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_device_names_are_checked() -> None:
    assert [check_device(d) for d in ("auto", "cpu", "cuda", "cuda:3")] == ["auto", "cpu", "cuda", "cuda:3"]
    for bad in ("gpu", "cuda:", "cuda:x", "mps"):
        with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
            EngineConfig(device=bad)
    assert is_cuda_device("cuda:0") and is_cuda_device("cuda") and not is_cuda_device("cpu")


def test_cuda_graphs_default_to_auto_and_an_explicit_on_needs_cuda() -> None:
    assert EngineConfig().cuda_graphs is None
    EngineConfig(cuda_graphs=False, device="cpu")
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs=True, device="cpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0.0)
    with pytest.raises(ValueError, match="kv_cache_gb"):
        EngineConfig(kv_cache_gb=0.0)


def test_a_cpu_worker_describes_its_cpu_without_a_memory_figure() -> None:
    info = describe_device(torch.device("cpu"))
    assert info.name == read_cpuinfo()[0]
    assert info.memory_bytes is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_worker_describes_its_gpu() -> None:
    info = describe_device(torch.device("cuda"))
    assert info.name and info.memory_bytes == torch.cuda.get_device_properties(0).total_memory


def test_worker_and_generate_take_device() -> None:
    for command in ("worker", "generate"):
        shown = subprocess.run(
            [sys.executable, "-m", "worker.cli", command, "--help"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        assert "--device {auto,cpu,cuda,cuda:N}" in shown
        assert "--gpu-memory-utilization" in shown and "--no-cuda-graphs" in shown
