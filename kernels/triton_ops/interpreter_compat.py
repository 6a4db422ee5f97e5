"""Make Triton's CPU interpreter (``TRITON_INTERPRET=1``) run our kernels faithfully.

Two interpreter gaps (Triton 3.6), neither of which exists on a GPU:

* bf16 is held as raw uint16 and ``tl.dot`` multiplies those raw bits; ``needs_upcast_dot`` tells the
  attention kernels to feed the dot fp32 copies instead (values unchanged, P still rounded to bf16).
* the scalar loop-bound conversion below.

The interpreter holds every scalar as a one-element array and converts it with ``int(array)`` when a
loop bound is a run-time value (``for start in range(lo, hi, BLOCK)``); NumPy 2.4 made that conversion
of a 1-d array an error (triton-lang/triton#9171, fixed upstream after 3.6). The patch below converts
through the array's single element instead. It is applied only in interpreter mode and only when this
NumPy raises; compiled kernels on a GPU never go through this code.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_applied = False


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def needs_upcast_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreter_enabled()


def _numpy_rejects_one_element_int() -> bool:
    import numpy as np

    try:
        int(np.zeros(1, dtype=np.int32))
    except TypeError:
        return True
    return False


def apply() -> None:
    """Patch the interpreter's scalar ``__index__`` once (idempotent)."""
    global _applied
    if _applied or not interpreter_enabled() or not _numpy_rejects_one_element_int():
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        # the scope restores attributes in reverse order, so the original comes back after the call
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _applied = True
