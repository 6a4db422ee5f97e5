"""Whether this machine can build the C kernels: their tests skip, naming why, without a compiler."""

from __future__ import annotations

import pytest

from kernels.cpu.build import KernelBuildError, compiler


def _has_compiler() -> bool:
    try:
        compiler()
    except KernelBuildError:
        return False
    return True


NEEDS_CC = pytest.mark.skipif(not _has_compiler(), reason="no C compiler on PATH")
