"""Triton kernels run on CUDA when there is a device, else under Triton's CPU interpreter (which
tests/conftest.py switches on for the whole suite). The fused C decode layer's tests get each build
this CPU can run (``kernel``), compiled once per module (``kernel_dir``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.cpu.decode import KERNELS, DecodeLayerKernel
from tests.kernels.decode_cases import key_id, load_build

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build cache for the module: each build compiles once."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module", params=list(KERNELS), ids=key_id)
def kernel(request: pytest.FixtureRequest, kernel_dir: Path) -> DecodeLayerKernel:
    """One of the fused decode layer's builds (skipped where this CPU cannot run it)."""
    return load_build(request.param, kernel_dir)
