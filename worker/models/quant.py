"""Block-quantized layers (GGUF Q8_0 / Q4_0 / Q4_1, ``kernels/quant_format.py``) and the CPU transform
that binds them to the C kernel (``kernels/cpu/qlinear.c``).

A quantized model is built with :class:`QuantLinear` and :class:`QuantEmbedding` in place of the float
modules (``gguf_model.py`` does it from a GGUF file, ``hf_quant.py`` from GPTQ / AWQ tensors); until
:func:`use_quant_kernels` runs, a layer computes the kernel's arithmetic in torch
(``qlinear_reference``: x quantized per block of 32 to int16, or int8 under ``quant_activations =
"int8"``; integer block sums), so a machine without a C compiler or AVX2 gets the same numbers, slowly.
That transform packs each weight into the kernel's interleaved layout and drops the unpacked copy. On
a GPU (or under Triton's interpreter) :func:`use_triton_quant_kernels` runs them weight-only instead:
blocks dequantized in the kernel, x as it is (``kernels/triton_ops/quant_linear.py``).

Mixed precision (``wire/full_precision.py``): :func:`quantize_linears` leaves the kept modules float,
:func:`keep_full_precision` dequantizes a quantized checkpoint's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from kernels.cpu.build import KernelBuildError
from kernels.cpu.qlinear import BoundQLinear, PackedQWeight, load_qlinear_kernel
from kernels.quant_format import QuantizedWeight, qlinear_reference
from wire.full_precision import keeps
from worker.cpu_isa import CpuCaps, IsaLevel

log = logging.getLogger(__name__)

TritonQLinear = Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None], torch.Tensor]


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
        # kernels.triton_ops.qlinear once use_triton_quant_kernels runs: weight-only, x in its dtype
        self._triton: Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None], torch.Tensor] | None = (
            None
        )

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

    def to_device(self, device: torch.device | str) -> None:
        """Move the weight (``nn.Module.to`` does not: it is not a parameter, and its scales must stay
        float32 whatever the model's dtype)."""
        if self._bound is not None:
            raise ValueError("to_device: the layer is bound to the CPU kernel")
        assert self.weight_q is not None
        self.weight_q = self.weight_q.to(device)
        if self.bias is not None:
            self.bias.data = self.bias.data.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._triton is not None:
            assert self.weight_q is not None
            return self._triton(x, self.weight_q, self.bias)
        flat = x.reshape(-1, self.in_features).float()
        if self._bound is not None:
            y = self._bound(flat)
        else:
            assert self.weight_q is not None
            y = qlinear_reference(flat, self.weight_q, self.bias, self.bits)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        if self._triton is not None:
            return f"{self.in_features} -> {self.out_features}, {self.kind}, Triton (weight-only)"
        kernel = "C kernel" if self._bound is not None else "torch reference"
        return f"{self.in_features} -> {self.out_features}, {self.kind}, x in int{self.bits}, {kernel}"


class QuantEmbedding(nn.Module):
    """Token embeddings kept quantized: a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def to_device(self, device: torch.device | str) -> None:
        self.weight_q = self.weight_q.to(device)

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


def _children(model: nn.Module, kind: type[nn.Module]) -> list[tuple[nn.Module, str, str, nn.Module]]:
    """Every submodule of type ``kind`` as (parent, attribute name, dotted path, module), listed before
    any is replaced."""
    return [
        (parent, name, f"{parent_name}.{name}" if parent_name else name, child)
        for parent_name, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, kind)
    ]


def quantize_linears(model: nn.Module, kind: str, keep: tuple[str, ...] = ()) -> int:
    """Quantize a float model's projections to ``kind`` on the fly (llama.cpp's reference quantizer):
    every nn.Linear becomes a QuantLinear (on the weight's device), the logits in ``LOGITS_KIND`` at
    most (tied ones read a quantized copy of the embedding, as GGUF files keep it); the embedding's
    lookups stay float, and so do the modules ``keep`` names (``wire/full_precision.py``). How many."""
    count, kept, kept_bytes, saved_bytes = 0, 0, 0, 0
    logits_kind = LOGITS_KIND if kind.startswith("q4") else kind
    for parent, name, path, child in _children(model, nn.Linear):
        assert isinstance(child, nn.Linear)
        chosen = logits_kind if child is getattr(model, "lm_head", None) else kind
        if keeps(keep, path):
            kept += 1
            kept_bytes += child.weight.numel() * child.weight.element_size()
            saved_bytes += QuantizedWeight.bytes_for(chosen, tuple(child.weight.shape))  # type: ignore[arg-type]
            continue
        weight = QuantizedWeight.quantize(child.weight, chosen).to(child.weight.device)
        setattr(parent, name, QuantLinear(weight, child.bias))
        count += 1
    embedding = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", True) is None and isinstance(embedding, nn.Embedding):
        if keeps(keep, "lm_head"):  # tied and kept: the logits read the float embedding, as before
            kept += 1
            saved_bytes += QuantizedWeight.bytes_for(logits_kind, tuple(embedding.weight.shape))  # type: ignore[arg-type]
        else:
            quantized = QuantizedWeight.quantize(embedding.weight, logits_kind).to(embedding.weight.device)
            model.lm_head = QuantLinear(quantized, None)
            count += 1
    log.info("%d linears quantized to %s (the logits to %s)", count, kind, logits_kind)
    if kept:
        log.info(
            "kept in full precision (%s): %d linears, %.1f MB more than quantized",
            ", ".join(keep),
            kept,
            (kept_bytes - saved_bytes) / 1e6,
        )
    return count


def keep_full_precision(model: nn.Module, keep: tuple[str, ...], dtype: torch.dtype) -> int:
    """A quantized checkpoint's QuantLinears that ``keep`` names replaced by float nn.Linears of their
    exact values in ``dtype`` (before ``use_quant_kernels``); how many. Logs the bytes it costs."""
    if not keep:
        return 0
    count, extra = 0, 0
    for parent, name, path, child in _children(model, QuantLinear):
        assert isinstance(child, QuantLinear)
        if not keeps(keep, path):
            continue
        weight = child.dequantized().to(dtype)
        linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if child.bias is not None:
            linear.bias = nn.Parameter(child.bias.detach().to(dtype), requires_grad=False)
        setattr(parent, name, linear)
        count += 1
        extra += weight.numel() * weight.element_size() - child.weight_bytes
    log.info(
        "kept in full precision (%s): %d linears dequantized to %s, %.1f MB more than quantized",
        ", ".join(keep),
        count,
        str(dtype).removeprefix("torch."),
        extra / 1e6,
    )
    return count


def check_keep_matches(model: nn.Module, keep: tuple[str, ...]) -> None:
    """Every ``layers.N…`` entry of ``keep`` names a module of this model (a typo keeps nothing)."""
    names = {name for name, _ in model.named_modules()}
    for entry in keep:
        if entry.startswith("layers.") and entry not in names:
            layers = len(getattr(model, "layers", ()))
            raise ValueError(f"keep_full_precision: {entry!r} is no module of this model ({layers} layers)")


def set_activation_bits(model: nn.Module, bits: int) -> None:
    """x's blocks in int16 or int8 for every QuantLinear (before ``use_quant_kernels`` binds them)."""
    for layer in model.modules():
        if isinstance(layer, QuantLinear):
            if layer.packed is not None:
                raise ValueError("set_activation_bits: the linears are bound already")
            layer.bits = bits


def use_triton_quant_kernels(model: nn.Module) -> int:
    """Run every QuantLinear through the Triton kernel (weight-only: x in its dtype); how many."""
    from kernels.triton_ops import qlinear

    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for layer in layers:
        layer._triton = qlinear
    if layers:
        log.info("%d quantized linears use the Triton kernel (weight-only)", len(layers))
    return len(layers)


def move_quantized(model: nn.Module, device: torch.device | str) -> None:
    """The quantized layers' weights onto ``device`` (after ``model.to(device)``, which skips them)."""
    for module in model.modules():
        if isinstance(module, QuantLinear | QuantEmbedding):
            module.to_device(device)


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
