"""Block-quantized layers (GGUF Q8_0 / Q4_0 / Q4_1, ``kernels/quant_format.py``) and the CPU transform
that binds them to the C kernel (``kernels/cpu/qlinear.c``).

A quantized model is built with :class:`QuantLinear` and :class:`QuantEmbedding` in place of the float
modules (``gguf_model.py`` does it from a GGUF file); until :func:`use_quant_kernels` runs, a layer
computes the kernel's arithmetic in torch (``qlinear_reference``: x quantized per block of 32 to
int16, or int8 under ``quant_activations = "int8"``; integer block sums), so a machine without a C
compiler or AVX2 gets the same numbers, slowly. The transform packs each weight into the kernel's
interleaved layout and drops the unpacked copy.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from kernels.cpu.build import KernelBuildError
from kernels.cpu.qlinear import BoundQLinear, PackedQWeight, load_qlinear_kernel
from kernels.quant_format import QuantizedWeight, qlinear_reference
from worker.cpu_isa import CpuCaps, IsaLevel

log = logging.getLogger(__name__)


class QuantLinear(nn.Module):
    """``x @ W.T + b`` with W block-quantized; float32 arithmetic, the output in ``x``'s dtype."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, bits: int = 16) -> None:
        super().__init__()
        self.kind = weight.kind
        self.bits = bits  # x's blocks: int16 (default, close to the float product) or int8 (llama.cpp's)
        self.out_features, self.in_features = weight.shape
        self.weight_q: QuantizedWeight | None = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.weight_bytes = weight.num_bytes
        self._bound: BoundQLinear | None = None

    def bind(self, bound: BoundQLinear) -> None:
        """Use the C kernel from now on; the unpacked weight is dropped (the kernel holds its own)."""
        self._bound, self.weight_q = bound, None
        self.weight_bytes = bound.weight.num_bytes

    def dequantized(self) -> torch.Tensor:
        """The weight's values [N, K] in float32 (from whichever copy the layer holds)."""
        if self.weight_q is not None:
            return self.weight_q.dequantize()
        assert self._bound is not None
        return self._bound.weight.dequantize()

    @property
    def packed(self) -> PackedQWeight | None:
        """The kernel's copy of the weight (None before ``bind``): what the fused layer reads too."""
        return None if self._bound is None else self._bound.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if self._bound is not None:
            y = self._bound(flat)
        else:
            assert self.weight_q is not None
            y = qlinear_reference(flat, self.weight_q, self.bias, self.bits)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = "C kernel" if self._bound is not None else "torch reference"
        return f"{self.in_features} -> {self.out_features}, {self.kind}, x in int{self.bits}, {kernel}"


class QuantEmbedding(nn.Module):
    """Token embeddings kept quantized: a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight_q.rows(ids.reshape(-1)).dequantize(self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)


# A pool's ``quantization`` (on the fly from a float checkpoint) -> the block format it uses: 8-bit in
# blocks of 32 (finer than per-channel scales), 4-bit asymmetric groups of 32 (as GPTQ/AWQ asym).
QUANTIZATION_KINDS = {"int8": "q8_0", "int4": "q4_1"}


# The logits stay 8-bit whatever the projections get (as llama.cpp's Q4 files keep their output
# tensor at 6-8 bits): SmolLM2's tied logits in Q4_1 alone cost 15% of its top-1 agreement
# (`bench quant`, int4), in Q8_0 nothing measurable.
LOGITS_KIND = "q8_0"


def quantize_linears(model: nn.Module, kind: str) -> int:
    """Quantize a float model's projections to ``kind`` on the fly (llama.cpp's reference quantizer):
    every nn.Linear becomes a QuantLinear, the logits in ``LOGITS_KIND`` at most (tied ones read a
    quantized copy of the embedding, as GGUF files keep it); the embedding's lookups stay float.
    How many."""
    count = 0
    logits_kind = LOGITS_KIND if kind.startswith("q4") else kind
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                chosen = logits_kind if child is getattr(model, "lm_head", None) else kind
                setattr(parent, name, QuantLinear(QuantizedWeight.quantize(child.weight, chosen), child.bias))
                count += 1
    embedding = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", True) is None and isinstance(embedding, nn.Embedding):
        model.lm_head = QuantLinear(QuantizedWeight.quantize(embedding.weight, logits_kind), None)
        count += 1
    log.info("%d linears quantized to %s (the logits to %s)", count, kind, logits_kind)
    return count


def set_activation_bits(model: nn.Module, bits: int) -> None:
    """x's blocks in int16 or int8 for every QuantLinear (before ``use_quant_kernels`` binds them)."""
    for layer in model.modules():
        if isinstance(layer, QuantLinear):
            if layer.packed is not None:
                raise ValueError("set_activation_bits: the linears are bound already")
            layer.bits = bits


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())


def quant_isa(caps: CpuCaps) -> str | None:
    """The qlinear build this CPU runs: AVX512-VNNI dot products, else AVX2's, else none."""
    if caps.level >= IsaLevel.AVX512 and "avx512_vnni" in caps.flags:
        return "avx512_vnni"
    if caps.level >= IsaLevel.AVX2:
        return "avx2"
    return None


def use_quant_kernels(model: nn.Module, caps: CpuCaps | None, cache_dir: Path) -> int:
    """Bind every QuantLinear of a CPU model to the C kernel; how many (0: skipped, reason logged)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers or caps is None:
        return 0
    isa = quant_isa(caps)
    if isa is None:
        log.info(
            "quantized linears: torch reference (the C kernel needs AVX2, the CPU is %s)", caps.level.label
        )
        return 0
    try:
        kernel = load_qlinear_kernel(isa, cache_dir)
    except KernelBuildError as exc:
        log.info("quantized linears: torch reference (%s)", exc)
        return 0
    for layer in layers:
        assert layer.weight_q is not None
        layer.bind(kernel.bind(layer.weight_q, layer.bias, layer.bits))
    total = sum(layer.weight_bytes for layer in layers)
    log.info("%d quantized linears use the %s C kernel (%.0f MB of weights)", len(layers), isa, total / 1e6)
    return len(layers)
