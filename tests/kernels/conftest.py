"""Triton kernels run on CUDA when there is a device, else under Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when a kernel is decorated, i.e. when ``kernels.triton_ops`` is first
imported, so it is set here, before any test module imports it.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")
