"""GPTQ and AWQ checkpoints served natively: each 4-bit projection converted exactly into q4_1 blocks.

The layouts, as AutoGPTQ / optimum / GPTQModel and AutoAWQ write them and vLLM's gptq / awq layers read
them, for a linear of K inputs, N outputs and groups of g inputs (g = K for GPTQ's group_size -1)::

    GPTQ  qweight int32 [K/8, N]    nibble j (bits 4j..4j+3) of qweight[i, n] = q[8i + j, n]
          qzeros  int32 [K/g, N/8]  nibble j of qzeros[r, c] = the stored zero of column 8c + j
          scales  fp16  [K/g, N]    g_idx int32 [K], optional: input k's group, which must be k // g
          z = stored + 1 ("gptq", v1: its packer stores zero - 1), z = stored ("gptq_v2")
    AWQ   qweight int32 [K, N/8]    nibble i of qweight[k, c] = q[k, 8c + ORDER[i]], ORDER = 0 2 4 6 1 3 5 7
          qzeros  int32 [K/g, N/8]  packed as qweight;  scales fp16 [K/g, N];  z = stored

    both  w[n, k] = scale[k // g, n] * (q[k, n] - z[k // g, n])

A v1 nibble of 15 is z = 16 (vLLM's kernel adds the 1 without wrapping). Act-order (``desc_act``) with
a g_idx that is not k // g puts a 32-block in several groups, which q4_1 cannot hold: refused.

Q4_1 (``kernels/quant_format.py``) holds every such weight exactly: each 32-block of a group gets
d = scale and c = -scale * z, so w = d q + c. An fp16 scale times an integer of 5 bits needs 16
significant bits, so d q, c and their sum are all exact in float32: the values are the format's own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.quant_format import BLOCK, QuantizedWeight
from worker.models.config import QuantConfig, UnsupportedModelError, WeightMismatchError
from worker.models.quant import QuantLinear

log = logging.getLogger(__name__)

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 holds column AWQ_ORDER[i]
_AWQ_UNDO = tuple(AWQ_ORDER.index(column) for column in range(8))  # column j sits in nibble _AWQ_UNDO[j]


def is_hf_quantized_folder(folder: Path) -> bool:
    """A checkpoint folder whose config.json carries a ``quantization_config`` (validated at load)."""
    file = folder / "config.json"
    return file.is_file() and bool(json.loads(file.read_text(encoding="utf-8")).get("quantization_config"))


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] -> int32 [..., M, 8]: nibble i is bits 4i..4i+3."""
    return (packed[..., None] >> _SHIFTS) & 0xF


def q4_1_from_groups(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """w[n, k] = scales[k // g, n] * (q[k, n] - zeros[k // g, n]) as q4_1: q [K, N] in 0..15, zeros and
    scales [K / g, N], g a multiple of 32."""
    cols, rows = q.shape
    num_groups = scales.shape[0]
    blocks_per_group = cols // num_groups // BLOCK
    d = scales.float().repeat_interleave(blocks_per_group, dim=0).T.contiguous()  # [N, K / 32]
    z = zeros.float().repeat_interleave(blocks_per_group, dim=0).T
    # a block's byte j: element j in the low nibble, element j + 16 in the high one
    blocks = q.T.reshape(rows, cols // BLOCK, 2, BLOCK // 2).to(torch.uint8)
    qs = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()
    return QuantizedWeight("q4_1", qs, d, (-(d * z)).contiguous())


def gptq_to_q4_1(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, checkpoint_format: str
) -> QuantizedWeight:
    """A GPTQ linear's tensors (see the module docstring; g_idx checked by the caller) as q4_1."""
    q = _nibbles(qweight.T).reshape(qweight.shape[1], -1).T  # [N, K/8, 8] -> [K, N]
    zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1)
    return q4_1_from_groups(q, zeros + 1 if checkpoint_format == "gptq" else zeros, scales)


def awq_to_q4_1(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """An AWQ (gemm) linear's tensors as q4_1."""
    undo = list(_AWQ_UNDO)
    q = _nibbles(qweight)[..., undo].reshape(qweight.shape[0], -1)
    zeros = _nibbles(qzeros)[..., undo].reshape(qzeros.shape[0], -1)
    return q4_1_from_groups(q, zeros, scales)


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None) -> None:
    if tuple(tensor.shape) != shape:
        raise WeightMismatchError(f"{name} has shape {tuple(tensor.shape)}; expected {shape}")
    if dtype is not None and tensor.dtype != dtype:
        raise WeightMismatchError(f"{name} is {tensor.dtype}; expected {dtype}")


class _Tensors:
    """The checkpoint's tensors by name (safetensors handles, read on demand)."""

    def __init__(self, handles: Mapping[str, Any]) -> None:
        self.handles = handles

    def __contains__(self, name: str) -> bool:
        return name in self.handles

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.handles[name].get_tensor(name)


def _part(quant: QuantConfig, prefix: str, tensors: _Tensors, cols: int) -> QuantizedWeight:
    """One checkpoint linear (``prefix``.qweight, ...) of ``cols`` inputs as q4_1, its shapes checked."""
    group = quant.group_size or cols
    if cols % BLOCK or cols % group:
        raise UnsupportedModelError(
            f"{prefix}: {cols} inputs do not split into groups of {group} in blocks of {BLOCK}"
        )
    qweight = tensors[f"{prefix}.qweight"]
    is_gptq = quant.method == "gptq"
    rows = qweight.shape[1] if is_gptq else 8 * qweight.shape[1]
    _check_shape(
        f"{prefix}.qweight", qweight, (cols // 8, rows) if is_gptq else (cols, rows // 8), torch.int32
    )
    qzeros, scales = tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"]
    _check_shape(f"{prefix}.qzeros", qzeros, (cols // group, rows // 8), torch.int32)
    _check_shape(f"{prefix}.scales", scales, (cols // group, rows), None)
    if not is_gptq:
        return awq_to_q4_1(qweight, qzeros, scales)
    if f"{prefix}.g_idx" in tensors:
        g_idx = tensors[f"{prefix}.g_idx"]
        _check_shape(f"{prefix}.g_idx", g_idx, (cols,), None)
        if not torch.equal(g_idx.long(), torch.arange(cols) // group):
            raise UnsupportedModelError(
                f"{prefix}.g_idx is not k // group_size (act-order, desc_act = {quant.desc_act}): its "
                "32-blocks span several groups, which q4_1 cannot hold; quantize with desc_act = false "
                "(or static_groups = true)"
            )
    return gptq_to_q4_1(qweight, qzeros, scales, quant.checkpoint_format)


def install_quant_projections(
    model: nn.Module,
    quant: QuantConfig,
    sources: Mapping[str, Sequence[str]],
    handles: Mapping[str, Any],
    device: torch.device | str,
) -> tuple[set[str], list[str]]:
    """Replace each nn.Linear ``sources`` names (our module path -> the checkpoint prefixes whose rows
    it stacks) with a QuantLinear of their tensors; returns (tensor names used, tensor names missing),
    installing nothing when some are missing."""
    required = ("qweight", "qzeros", "scales") + (("g_idx",) if quant.desc_act else ())
    optional = ("g_idx",) if quant.method == "gptq" else ()
    tensors = _Tensors(handles)
    targets = {path: model.get_submodule(path) for path in sources}
    used: set[str] = set()
    missing: list[str] = []
    for path, prefixes in sources.items():  # every name first, so that one message lists all of them
        target = targets[path]
        assert isinstance(target, nn.Linear)
        has_bias = target.bias is not None
        names = [f"{p}.{t}" for p in prefixes for t in required + (("bias",) if has_bias else ())]
        missing += [name for name in names if name not in tensors]
        used.update(name for name in names if name in tensors)
        used.update(f"{p}.{t}" for p in prefixes for t in optional if f"{p}.{t}" in tensors)
        if not has_bias:  # old AutoGPTQ gave every layer a bias: zeros carry nothing, others are unexpected
            extras = [f"{p}.bias" for p in prefixes if f"{p}.bias" in tensors]
            used.update(name for name in extras if not tensors[name].any())
    if missing:
        return used, missing
    linears: dict[str, QuantLinear] = {}
    for path, prefixes in sources.items():
        target = targets[path]
        assert isinstance(target, nn.Linear)
        weight = QuantizedWeight.cat([_part(quant, p, tensors, target.in_features) for p in prefixes])
        if weight.shape != (target.out_features, target.in_features):
            raise WeightMismatchError(
                f"{' + '.join(prefixes)} give a {weight.shape} weight; {path} expects "
                f"{(target.out_features, target.in_features)}"
            )
        has_bias = target.bias is not None
        bias = torch.cat([tensors[f"{p}.bias"].float() for p in prefixes]) if has_bias else None
        linears[path] = QuantLinear(weight.to(device), None if bias is None else bias.to(device))
    for path, linear in linears.items():
        model.set_submodule(path, linear)
    log.info(
        "%d %s projections as q4_1 (%s, group %s, %s)",
        len(linears),
        quant.method,
        quant.checkpoint_format,
        quant.group_size or "per row",
        "sym" if quant.sym else "asym",
    )
    return used, missing
