"""Triton kernels for the GPU path, each checked against the torch reference it replaces.

Importing this package imports Triton; the CPU path (``kernels/*.py``) never does. On CPU the kernels run
under Triton's interpreter when ``TRITON_INTERPRET=1`` was set before this package was imported (that is
how the tests run them). See docs/kernels.md.
"""

from __future__ import annotations

from kernels.triton_ops import interpreter_compat

interpreter_compat.apply()

from kernels.triton_ops.activation import silu_and_mul  # noqa: E402
from kernels.triton_ops.decode_attention import paged_decode_attention  # noqa: E402
from kernels.triton_ops.kv_store import store_kv  # noqa: E402
from kernels.triton_ops.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from kernels.triton_ops.prefill_attention import paged_prefill_attention  # noqa: E402
from kernels.triton_ops.quant_linear import qlinear  # noqa: E402
from kernels.triton_ops.rotary import apply_rotary, rotate  # noqa: E402

__all__ = [
    "apply_rotary",
    "fused_add_rms_norm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "qlinear",
    "rms_norm",
    "rotate",
    "silu_and_mul",
    "store_kv",
]
