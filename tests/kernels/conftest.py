"""Triton kernels run on CUDA when there is a device, else under Triton's CPU interpreter (which
tests/conftest.py switches on for the whole suite)."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")
