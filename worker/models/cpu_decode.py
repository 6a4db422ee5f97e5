"""Decode-only steps of a CPU model, one C call per layer (``kernels/cpu/decode_f32.c``, and
``decode_bf16.c`` for bfloat16 models on AVX512-BF16 CPUs; the ``_kv16`` builds over a bfloat16 cache).

A batch-1 step through torch ops is ~45 ops a layer; on SmolLM2 (30 layers, 2-core EPYC) that was
~7 ms of a 19 ms float32 step on top of reading the weights. The fused layer does the same arithmetic
(float32: up to rounding, and the greedy-equivalence tests run on it; bfloat16: activations stay
float32 through a layer, where torch rounds after every op) in one call, reading K/V from the paged
cache in place. The runner uses it for every step of at most ``max_rows`` tokens, a token a row:
decodes, and prefill chunks beside them (each prefill row attends up to its own position), and for
larger steps in slices where the build was measured faster (``SLICED_MEAN_CONTEXT``); the others keep
the torch path. Through the torch path a 16-token chunk beside one decode cost ~110 ms on the 2-core
EPYC (AVX2, float32), ~45 ops a layer around MKL's sgemm at 17 rows.

Built after ``use_decode_linears`` (same weights, same arena); skipped with one log line where the
kernel cannot serve the model or the CPU.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
from torch import nn

from kernels.cpu.build import KernelBuildError
from kernels.cpu.decode import (
    DecodeLayerKernel,
    LayerArgs,
    QWeightArgs,
    StepArgs,
    load_decode_kernel,
    load_quant_decode_kernel,
)
from kernels.cpu.qlinear import KIND_CODES
from worker.cpu_isa import CpuCaps, IsaLevel
from worker.models.cpu_linear import PanelLinear
from worker.models.llama import DecoderLayer, LlamaForCausalLM
from worker.models.quant import QuantLinear, is_quantized, quant_isa

log = logging.getLogger(__name__)

# Rows of one fused call (a larger step goes in even slices). float32: the kernel's own row block
# (linear_f32.c's ROW_BLOCK, 256; ``DecodeLayerKernel.row_block``), one pass over the weights a call,
# where the tiles over packed panels run near the FMA peak from ~64 rows (AVX-512 8-row tiles ~490
# GFLOPS, AVX2 4-row tiles ~230; MKL's sgemm ~160 on a 2-core Zen 5 EPYC). At 128 a served burst's
# mixed steps (a ~130-token prompt beside 16 decodes, 146 rows) went as 128 + 18 rows, each slice
# reading every weight: 148.5 -> 136.1 ms with one slice of 146, AVX2 216 -> 203 ms; a lone 300-token
# prompt 280 ms against 285 in slices of 100, 1,000 tokens level (2-core Intel Xeon). bfloat16: 32.
MAX_ROWS = {"avx512_bf16": 32}
# Block-quantized linears: VNNI's 512-bit tile (qlinear.c's tile512) runs SmolLM2's linears at 32
# rows in 18 ms, 128 rows in 55 ms (~490 GFLOPS) on the 2-core EPYC (Zen 5); a 10 x 200-token
# prefill step took 1.12 s in slices of 64 rows, ~1.0 in slices of 128 (256 and 512: no better).
QUANT_MAX_ROWS = {"avx512_vnni": 128, "avx2": 32}
# Builds (by ISA, float and quantized as for the row counts above) that take a step of any size as
# slices of at most max_rows rows, while the prompt rows' mean context stays within this; past it the
# torch path's SDPA. A cold prompt of 8,100 tokens in the default 2,048-token chunks (chunk means
# ~1,024, 3,072, 5,120, 7,100), each chunk fused vs torch, 2-core Intel Xeon (AMX; "AVX2": capped):
# Q4_1 VNNI 1.96 / 3.14 / 4.46 / 5.85 s against 2.77 / 4.35 / 5.86 / 7.11; Q4_1 AVX2 4.33 / 6.94 /
# 9.61 / 11.01 against 5.29 / 7.40 / 9.77 / 11.73; float32 AVX-512 2.07 / 3.49 / 5.18 / 6.39 against
# 2.49 / 4.22 / 5.90 / 7.31; float32 AVX2 (6,100 tokens) 3.40 / 5.53 / 7.73 against 5.21 / 6.76 / 8.40.
# The AVX2 builds stop at 4,096, where their lead (0.82-0.94 below it) falls to 0.92-0.98. (The
# bound was 1,024 for these before: a 2,048-token chunk from position 0, mean 1,024.5, went through
# the torch path, 1.2-1.6x slower.) Earlier, on the 2-core EPYC (Zen 5), 10 x 200-token prompts in
# one step: float32 AVX-512 1.75 vs 3.17 s, Q4_1 VNNI 1.61 vs 2.40, Q4_1 AVX2 2.82 vs 3.40; the
# float32 AVX2 32-request burst 323-325 tok/s in slices of 128 against 284-303 (prefill steps 6.1 s
# against 8.7). bfloat16: 0, decode-only steps (its linears are for few rows; prompts past 32 rows
# keep the torch path's AMX GEMMs): one decode step, random cache, 2-core Intel Xeon, 64 rows at ~300
# tokens 107 ms fused in slices of 32 against 123 through the torch path, 48 rows at ~1,500 192
# against 348-359 (the torch path's figure with the logits).
SLICED_MEAN_CONTEXT = {"avx512": 8192, "avx2": 4096, "avx512_bf16": 0}
QUANT_SLICED_MEAN_CONTEXT = {"avx512_vnni": 8192, "avx2": 4096}


class CpuDecodeStep:
    """``run`` one step, decodes and prefill chunks alike (a token a row): hidden states [T, hidden]
    (final norm applied), as ``LlamaForCausalLM.forward`` returns them. The layer writes every row's
    K/V before any row attends, so a prefill token, given its own context length (position + 1),
    attends causally to the chunk's earlier tokens as to the cached context. ``can_run``: steps of
    up to ``max_rows`` rows, and larger ones in slices where the build was measured faster than the
    torch path (``SLICED_MEAN_CONTEXT``)."""

    takes_prefill = True

    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], kernel: DecodeLayerKernel
    ) -> None:
        self.model, self.kv_caches, self.kernel = model, kv_caches, kernel
        if kernel.quantized:
            self.max_rows = QUANT_MAX_ROWS[kernel.isa]
        else:
            self.max_rows = kernel.row_block or MAX_ROWS[kernel.isa]
        sliced = QUANT_SLICED_MEAN_CONTEXT if kernel.quantized else SLICED_MEAN_CONTEXT
        self.sliced_mean_context = sliced.get(kernel.isa)  # None: steps of max_rows at most
        cfg = model.config
        self.sliding_window = cfg.sliding_window or 0
        self.layers: list[LayerArgs] = []
        self._keep: list[torch.Tensor] = []  # contiguous copies a pointer refers to
        self._structs: list[QWeightArgs] = []  # the quantized weights' descriptors the layers point to
        for layer, kv in zip(model.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            self.layers.append(self._layer_args(layer, kv))
        self._work = torch.empty(0)
        self._unit_starts = torch.empty(0, dtype=torch.int64)  # attention's units, filled a slice at a time

    def _tensor(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        if not t.is_contiguous():
            t = t.contiguous()
            self._keep.append(t)
        return t.data_ptr()

    def _weight(self, linear: nn.Module) -> int | None:
        """The address the kernel reads a linear's weight from: the tensor, or (quantized) a QWeightArgs
        naming its packed arrays."""
        if not self.kernel.quantized:
            if self.kernel.dtype == torch.float32:  # packed in panels by use_decode_linears (arena)
                assert isinstance(linear, PanelLinear), f"{type(linear).__name__}: pack it first"
                return linear.packed.data_ptr()
            assert isinstance(linear.weight, torch.Tensor)
            return self._tensor(linear.weight)
        assert isinstance(linear, QuantLinear) and linear.packed is not None
        packed = linear.packed
        args = QWeightArgs(
            kind=KIND_CODES[packed.kind],
            bits=linear.bits,
            qs=packed.qs.data_ptr(),
            d=packed.d.data_ptr(),
            c=None if packed.c is None else packed.c.data_ptr(),
        )
        self._structs.append(args)
        return ctypes.addressof(args)

    def _layer_args(self, layer: DecoderLayer, kv: torch.Tensor) -> LayerArgs:
        _, _, num_blocks, block_size, _ = kv.shape
        t, w = self._tensor, self._weight
        return LayerArgs(
            hidden=layer.o_proj.out_features,
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            inter=layer.down_proj.in_features,
            eps=layer.input_layernorm.eps,
            scale=layer.scale,
            ln1=t(layer.input_layernorm.weight),
            ln2=t(layer.post_attention_layernorm.weight),
            w_qkv=w(layer.qkv_proj),
            w_o=w(layer.o_proj),
            w_gate_up=w(layer.gate_up_proj),
            w_down=w(layer.down_proj),
            b_qkv=t(layer.qkv_proj.bias),
            b_o=t(layer.o_proj.bias),
            b_gate_up=t(layer.gate_up_proj.bias),
            b_down=t(layer.down_proj.bias),
            kv=kv.data_ptr(),  # the runner's cache itself: written in place, never a copy
            num_blocks=num_blocks,
            block_size=block_size,
        )

    def can_run(self, seq_lens: list[int], in_prompt: list[bool]) -> bool:
        """Up to ``max_rows`` rows; more in slices (where the build slices) while the prompt rows'
        mean context is within the bound: the torch path's SDPA is ahead only on long prompts. Output
        rows count for nothing there: 64 decodes at ~1,100 tokens of context took 255 ms fused in
        slices of 32 against 1,357 through the torch path (Q4_1, AVX2-capped, 2-core Intel Xeon),
        where the bound over every row's context had sent them to the torch path."""
        if len(seq_lens) <= self.max_rows:
            return True
        bound = self.sliced_mean_context
        prompt = [n for n, p in zip(seq_lens, in_prompt, strict=True) if p]
        return bound is not None and sum(prompt) <= bound * len(prompt)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_rows: list[list[int]],
        in_prompt: list[bool],
    ) -> torch.Tensor:
        """Rows in slices of at most ``max_rows``, each through every layer before the next: a
        request's tokens come in position order, so a later slice attends to the K/V an earlier one
        wrote, as a later prefill chunk does (the linears stay in the row counts they are fast at,
        and the scratch in cache). A prompt's rows attend in tiles, output rows one at a time
        (``attention_units``): each row's result the same bits however the step was cut."""
        model = self.model
        num_rows = len(input_ids)
        # float32 through the layers whatever the model's dtype (a no-op copy-free for float32)
        hidden = model.embed_tokens(torch.tensor(input_ids, dtype=torch.int64)).float()
        residual = torch.empty_like(hidden)
        cos_sin = model.cos_sin_cache[torch.tensor(positions, dtype=torch.int64)]
        header = torch.tensor([slot_mapping, seq_lens], dtype=torch.int64)
        prompt_rows = torch.tensor(in_prompt, dtype=torch.uint8)
        if prompt_rows.shape != (num_rows,):
            raise ValueError(f"in_prompt: expected {num_rows} flags, got {prompt_rows.shape[0]}")
        width = max(len(row) for row in block_rows)
        tables = torch.tensor([row + [0] * (width - len(row)) for row in block_rows], dtype=torch.int64)
        slices = -(-num_rows // self.max_rows)
        rows_a_call = -(-num_rows // slices)  # as even as they go: 300 rows are 150 + 150, not 256 + 44
        need = self.kernel.work_floats(self.layers[0], rows_a_call)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        if self._unit_starts.numel() <= rows_a_call:
            self._unit_starts = torch.empty(rows_a_call + 1, dtype=torch.int64)
        call = self.kernel.layer
        for start in range(0, num_rows, rows_a_call):
            end = min(num_rows, start + rows_a_call)
            step = StepArgs(
                num_rows=end - start,
                hidden=hidden[start].data_ptr(),
                residual=residual[start].data_ptr(),
                first=1,
                cos_sin=cos_sin[start].data_ptr(),
                slots=header[0, start].data_ptr(),
                block_tables=tables[start].data_ptr(),
                table_width=width,
                seq_lens=header[1, start].data_ptr(),
                sliding_window=self.sliding_window,
                work=self._work.data_ptr(),
                num_threads=torch.get_num_threads(),
                in_prompt=prompt_rows.data_ptr() + start,
            )
            self.kernel.attention_units(self.layers[0], step, self._unit_starts)
            step_ref = ctypes.byref(step)
            for layer in self.layers:
                call(ctypes.byref(layer), step_ref)
                step.first = 0
        norm, dtype = model.norm, self.kernel.dtype
        hidden, _ = model.ops.fused_add_rms_norm(hidden.to(dtype), residual.to(dtype), norm.weight, norm.eps)
        return hidden


def fused_isa(model: LlamaForCausalLM, caps: CpuCaps) -> tuple[str | None, str]:
    """(the build to load, or None; why not) for this model on this CPU."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None, "not a float32 or bfloat16 model on CPU"
    if is_quantized(model):
        linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, QuantLinear)]
        if weight.dtype != torch.float32:
            return None, f"block-quantized weights take a float32 model (norms, cache), not {weight.dtype}"
        if any(m.packed is None for m in linears):
            return None, "its quantized linears run the torch reference (no C kernel bound)"
        if len(linears) < 4 * len(model.layers):
            return None, "mixed precision: its layers keep float linears (keep_full_precision)"
        return quant_isa(caps), ""
    if weight.dtype == torch.bfloat16:
        if not caps.native_bf16:
            return None, f"a bfloat16 model needs AVX512-BF16, the CPU is {caps.level.label}"
        return "avx512_bf16", ""
    if caps.level < IsaLevel.AVX2:
        return None, f"the kernel needs AVX2, the CPU is {caps.level.label}"
    return ("avx512" if caps.level >= IsaLevel.AVX512 else "avx2"), ""


def fused_decode_step(
    model: LlamaForCausalLM, kv_caches: list[torch.Tensor], caps: CpuCaps | None, cache_dir: Path
) -> CpuDecodeStep | None:
    """The fused decode step for this model, or None (the reason logged once)."""
    if caps is None:
        return None
    isa, why_not = fused_isa(model, caps)
    dtype = next(model.parameters()).dtype
    kv_dtype = kv_caches[0].dtype if kv_caches else dtype
    kernel: DecodeLayerKernel | None = None
    if isa is not None:
        try:
            if is_quantized(model):
                kernel = load_quant_decode_kernel(isa, cache_dir, kv_dtype)
            else:
                kernel = load_decode_kernel(isa, cache_dir, dtype, kv_dtype)
        except KernelBuildError as exc:
            why_not = str(exc)
        except ValueError:  # no build for this pair of dtypes (e.g. a bf16 model over a float32 cache)
            why_not = f"no fused build for {dtype} weights over a {kv_dtype} KV cache"
    head_dim = model.config.head_dim
    if kernel is not None and (head_dim > kernel.max_head_dim or head_dim % 2):
        why_not = f"head_dim {head_dim} (the kernel takes even ones up to {kernel.max_head_dim})"
        kernel = None
    if kernel is None:
        log.info("decode steps: no fused C layer: %s", why_not)
        return None
    step = CpuDecodeStep(model, kv_caches, kernel)
    weights = "block-quantized" if kernel.quantized else str(dtype)
    log.info(
        "decode steps of up to %d sequences: one fused %s %s C call per layer (KV cache %s)",
        step.max_rows, weights, isa, kv_dtype,
    )  # fmt: skip
    return step
