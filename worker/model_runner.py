"""Turns a scheduled step into one flat ragged batch, runs the model and returns logits.

For a step with a decode of request A (context 37) and a prefill chunk of B (tokens 16..47):

    input_ids     [ a36 | b16 b17 ... b47 ]          T = 1 + 32 tokens, no padding
    positions     [ 36  | 16  17  ... 47  ]
    slot_mapping  [ A.block_ids[36 // 16] * 16 + 36 % 16 | B.block_ids[1] * 16 + 0 ... ]
    query_start   [ 0, 1, 33 ]
    seq_lens      [ 37, 48 ]
    block_tables  [ A.block_ids + pad ; B.block_ids + pad ]

Only the last token of a request whose prompt is now fully computed is turned into logits, and after
those rows, the rows of a prompt that is scored (``SamplingParams.prompt_logprobs``: every row whose
next token is a prompt token: ``SchedulerOutput.score_spans``).

Kernels: the torch references on CPU, the Triton kernels on CUDA (``EngineConfig.kernel_backend``), the
choice logged once at startup. A decode-only step (every sequence one new token) may take a faster
road, a ``DecodeStep``: with ``cuda_graphs`` (on by default on CUDA) it replays a CUDA graph
captured for the smallest bucket >= B, its inputs padded (``worker.decode_graphs``); on CPU, with
``cpu_kernels``, it runs one fused C call per layer (``worker.models.cpu_decode``), for any step its
``can_run`` takes (up to ``max_rows`` tokens, or more in slices on the builds where that is faster),
prefill chunks included (a token a row). Other steps run the model eagerly.

The sampler's row operations (the greedy argmax, the top-k / top-p cut) are the runner's ``sampling``:
on CPU with ``cpu_kernels`` the C kernels of ``kernels/cpu/sampling.c``, elsewhere the torch
references (``kernels/sampling.py``); the same tokens either way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Protocol

import torch

from kernels.cpu.build import KernelBuildError
from kernels.cpu.sampling import CpuSamplingOps, load_sampling_kernels
from kernels.sampling import TORCH_SAMPLING, SamplingOps
from worker.attention import (
    AttentionMetadata,
    KernelBackend,
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    make_attention_backend,
)
from worker.config import EngineConfig
from worker.cpu_isa import probe
from worker.decode_graphs import decode_graphs
from worker.devices import resolve_device
from worker.kv_budget import kv_cache_blocks
from worker.models.config import ModelConfig, UnsupportedModelError
from worker.models.cpu_decode import fused_decode_step
from worker.models.cpu_linear import use_decode_linears
from worker.models.cpu_packing import pack_linears_if_supported
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import load_model
from worker.models.quant import (
    QUANTIZATION_KINDS,
    check_keep_matches,
    is_quantized,
    keep_full_precision,
    quantize_linears,
    set_activation_bits,
    use_quant_kernels,
    use_triton_quant_kernels,
)
from worker.models.store import kernel_cache_dir
from worker.request import Request
from worker.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


class DecodeStep(Protocol):
    """A step's hidden states [T, hidden] by other means than the eager model, one row a token.

    ``takes_prefill``: whether the rows may be prefill tokens too (each with its own context length:
    position + 1, and its sequence's block table; the K/V of every row are written before any row
    attends), or only one decode token per sequence. ``in_prompt``: each row's token is the client's
    prompt's (else an output token: a decode, one recomputed after a preemption, or one another
    worker generated before a failover: ``Request.outputs_from``)."""

    takes_prefill: bool

    def can_run(self, seq_lens: list[int], in_prompt: list[bool]) -> bool: ...

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_rows: list[list[int]],
        in_prompt: list[bool],
    ) -> torch.Tensor: ...


class StepRunner(Protocol):
    """What the engine needs from a runner: run one scheduled step, return logits to sample from;
    ``sampling``: the sampler's row operations over those logits (the torch references, or faster
    ones with the same results)."""

    device: torch.device

    @property
    def sampling(self) -> SamplingOps: ...

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        """The requests whose next token is sampled, and the logits: one row for each of them, in that
        order, then one for each row of ``out.score_spans`` in theirs."""
        ...


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        backend: KernelBackend = KernelBackend.TORCH,
        decode_step: DecodeStep | None = None,
        sampling: SamplingOps = TORCH_SAMPLING,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.decode_step = decode_step
        self.sampling = sampling

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        """Run one step; return the requests that need a new token and the logits [N, V] fp32 (theirs,
        then the scored prompt rows': ``StepRunner.execute``)."""
        step, sampled = step_inputs(out, self.block_size)
        fast = self.decode_step
        decode_only = step.num_decodes == len(out.scheduled)
        # one row a token: a decode's context is its sequence's; a prefill token's ends at itself
        row_lens = step.seq_lens if decode_only else [p + 1 for p in step.positions]
        if fast is not None and (decode_only or fast.takes_prefill):
            rows = [r for r in out.scheduled for _ in range(out.num_scheduled_tokens[r.request_id])]
            in_prompt = [p < r.outputs_from for r, p in zip(rows, step.positions, strict=True)]
            if fast.can_run(row_lens, in_prompt):
                block_rows = [r.block_ids for r in rows]
                hidden = fast.run(
                    step.input_ids, step.positions, step.slot_mapping, row_lens, block_rows, in_prompt
                )
                return sampled, self.logits(hidden, step)
        return sampled, self.forward(step)

    def forward(self, step: StepInputs) -> torch.Tensor:
        """The eager model over ``step``: the logits of its ``logits_indices`` rows (empty: none)."""
        device = self.device
        meta = AttentionMetadata.build(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            block_tables=step.block_tables().to(device),
            num_decodes=step.num_decodes,
            block_size=self.block_size,
            sliding_window=self.model.config.sliding_window,
            backend=self.backend,
        )
        hidden = self.model(
            torch.tensor(step.input_ids, dtype=torch.int64, device=device),
            torch.tensor(step.positions, dtype=torch.int64, device=device),
            self.kv_caches,
            meta,
        )
        return self.logits(hidden, step)

    def logits(self, hidden: torch.Tensor, step: StepInputs) -> torch.Tensor:
        if not step.logits_indices:
            return torch.empty(0)
        index = torch.tensor(step.logits_indices, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, index))


@dataclasses.dataclass(slots=True)
class StepInputs:
    """One step's flat ragged batch, in the scheduler's layout (decodes first, then prefill chunks):
    a token per row of ``input_ids`` / ``positions`` / ``slot_mapping``, a sequence per row of
    ``seq_lens`` / ``block_tables`` (zero-padded), and the rows whose logits are sampled."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_ids: list[list[int]]  # each sequence's blocks (its request's own list: read, not copied)
    num_decodes: int
    logits_indices: list[int]  # the sampled requests' last rows, then the scored prompts' rows

    def block_tables(self) -> torch.Tensor:
        """[num_seqs, max_blocks] int64 on the CPU, each row zero-padded."""
        width = max(len(ids) for ids in self.block_ids)
        return torch.tensor([ids + [0] * (width - len(ids)) for ids in self.block_ids], dtype=torch.int64)


def step_inputs(out: SchedulerOutput, block_size: int) -> tuple[StepInputs, list[Request]]:
    """``out`` as model inputs, and the requests whose last new token is sampled (in row order); the
    logits rows are theirs, then those of the step's scored prompts (``out.score_spans``)."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sampled: list[Request] = []
    num_decodes = sum(1 for r in out.scheduled if out.num_scheduled_tokens[r.request_id] == 1)
    for request in out.scheduled:
        start = request.num_computed_tokens
        num_new = out.num_scheduled_tokens[request.request_id]
        end = start + num_new
        input_ids.extend(request.all_token_ids[start:end])
        span = range(start, end)
        positions.extend(span)
        block_ids = request.block_ids
        slot_mapping.extend(block_ids[p // bs] * bs + p % bs for p in span)
        query_start_loc.append(query_start_loc[-1] + num_new)
        seq_lens.append(end)
        if end == request.num_tokens:
            logits_indices.append(query_start_loc[-1] - 1)
            sampled.append(request)
    if out.score_spans:  # each request's rows start at its query_start_loc
        first_rows = {r.request_id: row for r, row in zip(out.scheduled, query_start_loc[:-1], strict=True)}
        for scored in out.score_spans:
            first = first_rows[scored.request.request_id]
            logits_indices.extend(range(first, first + scored.num_rows))
    step = StepInputs(
        input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_ids=[r.block_ids for r in out.scheduled],
        num_decodes=num_decodes, logits_indices=logits_indices,
    )  # fmt: skip
    return step, sampled


def resolve_kernel_backend(config: EngineConfig, device: torch.device) -> KernelBackend:
    """``auto``: Triton on CUDA, the torch references elsewhere."""
    if config.kernel_backend == "torch" or (config.kernel_backend == "auto" and device.type != "cuda"):
        return KernelBackend.TORCH
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"kernel_backend: 'triton' on {device.type} runs only under Triton's interpreter; "
            "set TRITON_INTERPRET=1 before starting (slow: meant for tests on tiny models)"
        )
    return KernelBackend.TRITON


def apply_quantization(model: LlamaForCausalLM, config: EngineConfig, model_path: Path) -> None:
    """The pool's ``quantization`` (a float checkpoint quantized on the fly) and its
    ``keep_full_precision`` (the modules left, or made, float)."""
    keep = config.keep_full_precision
    check_keep_matches(model, keep)
    if config.quantization != "none":
        if is_quantized(model):
            raise ValueError(f"quantization: {model_path} is quantized already; set quantization = 'none'")
        quantize_linears(model, QUANTIZATION_KINDS[config.quantization], keep)
    elif keep:
        if not is_quantized(model):
            raise ValueError(
                f"keep_full_precision: {model_path} is not quantized (set quantization = 'int8' or 'int4', "
                "or serve a GGUF / GPTQ / AWQ checkpoint)"
            )
        keep_full_precision(model, keep, config.torch_dtype)


def _shard(model: LlamaForCausalLM, config: EngineConfig) -> ModelConfig:
    """Keep this rank's shard (worker/models/tensor_parallel.py); its config sizes the KV cache."""
    from worker.models.tensor_parallel import plan_shards, shard_model

    if is_quantized(model):
        raise UnsupportedModelError("tensor parallelism takes float weights; this model is quantized")
    plan = plan_shards(model.config, config.tensor_parallel_rank, config.tensor_parallel_size)
    sharded = shard_model(model, plan)
    log.info(
        "tensor parallel rank %d of %d: query heads %s, K/V heads %s, MLP channels %s, vocabulary %s",
        plan.rank, plan.world, plan.q_heads, plan.kv_heads, plan.inter, plan.vocab,
    )  # fmt: skip
    return sharded


def build_model_runner(config: EngineConfig, model_path: Path) -> tuple[ModelRunner, ModelConfig, int]:
    """Load the model, size and allocate its KV cache: (runner, model config, number of KV blocks)."""
    config = resolve_device(config)
    device = torch.device(config.device)
    backend = resolve_kernel_backend(config, device)
    attention = make_attention_backend(backend)
    model, model_config = load_model(model_path, config.torch_dtype, device, attention)
    apply_quantization(model, config, model_path)
    if config.tensor_parallel_size > 1:
        model_config = _shard(model, config)
        # the torch path: the fused C layer and CUDA graphs do not take a sharded layer's all-reduces
        config = dataclasses.replace(config, cpu_kernels=False, cuda_graphs=False)
    if backend is KernelBackend.TRITON:
        from kernels.triton_ops.layer_ops import TritonLayerOps

        model.use_kernels(TritonLayerOps(), attention)
        use_triton_quant_kernels(model)
    caps = probe() if device.type == "cpu" and backend is KernelBackend.TORCH else None
    quantized = is_quantized(model)
    if quantized and backend is KernelBackend.TORCH:  # block-quantized weights: their own kernel
        set_activation_bits(model, 16 if config.quant_activations == "int16" else 8)
        if config.cpu_kernels:
            use_quant_kernels(model, caps, kernel_cache_dir())
    # Float linears (all, or those kept in full precision): our C kernels first; a bf16 model they do
    # not take (no AVX512-BF16) gets oneDNN's packing.
    has_float = model.lm_head is None or any(isinstance(m, torch.nn.Linear) for m in model.modules())
    bound = has_float and config.cpu_kernels and use_decode_linears(model, caps, kernel_cache_dir())
    if has_float and not bound and not quantized:
        pack_linears_if_supported(model, caps)
    mc = model_config
    kv_dtype = config.kv_torch_dtype(config.torch_dtype, backend is KernelBackend.TRITON, quantized)
    bytes_per_block = kv_cache_bytes_per_block(
        mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, kv_dtype
    )
    num_blocks = kv_cache_blocks(config, model, mc, device, backend, bytes_per_block)
    kv_caches = allocate_kv_cache(
        mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim, kv_dtype, device
    )
    log.info(
        "engine: %s (%s) on %s in %s, kernels %s, attention %s, %d KV blocks of %d tokens (%.2f GiB, %s), "
        "prefix caching %s",
        model_path.name,
        mc.architecture,
        device,
        config.dtype,
        backend.value,
        type(attention).__name__,
        num_blocks,
        config.block_size,
        num_blocks * bytes_per_block / 1024**3,
        str(kv_dtype).removeprefix("torch."),
        "on" if config.enable_prefix_caching else "off",
    )
    decode_step: DecodeStep | None = None
    if config.cpu_kernels and caps is not None:
        decode_step = fused_decode_step(model, kv_caches, caps, kernel_cache_dir())
    graphs = decode_graphs(config, model, kv_caches, mc, device, backend)
    runner_class = ModelRunner
    if config.tensor_parallel_size > 1:
        from worker.tp_step import TensorParallelRunner  # imports this module

        runner_class = TensorParallelRunner
    sampling = cpu_sampling(kernel_cache_dir()) if config.cpu_kernels and device.type == "cpu" else None
    runner = runner_class(
        model,
        kv_caches,
        config.block_size,
        device,
        backend,
        graphs or decode_step,
        sampling or TORCH_SAMPLING,
    )
    return runner, model_config, num_blocks


def cpu_sampling(cache_dir: Path) -> CpuSamplingOps | None:
    """The sampler's row operations in C (``kernels/cpu/sampling.c``: the greedy argmax ~0.3 ms where
    torch's ``max`` took ~1.1 ms of a 32-row AVX2 decode step; the top-k / top-p cut by selection where
    torch sorted every row), or None without a C compiler (logged)."""
    try:
        return load_sampling_kernels(cache_dir)
    except KernelBuildError as exc:
        log.info("sampling: torch's row operations (no C kernel: %s)", exc)
        return None
