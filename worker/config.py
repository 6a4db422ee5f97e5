"""Engine configuration: one typed record, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wire.config import DEFAULT_MODEL_PATH
from wire.full_precision import check_entries
from worker.devices import check_device

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# "auto": chosen by the device and the CPU probe (worker/precision.py) when the engine is built.
DTYPE_CHOICES = ("auto", *DTYPES)
# "auto": Triton kernels on CUDA, torch references on CPU. "triton" on CPU needs TRITON_INTERPRET=1
# (Triton's interpreter: slow, for tests on tiny models).
KERNEL_BACKENDS = ("auto", "torch", "triton")
QUANT_ACTIVATIONS = ("int16", "int8")
# "bfloat16" under a float32 model (or a block-quantized one, whose activations are float32): K/V
# rounded to bf16 where they are stored, half the bytes a decode step's attention reads and twice the
# tokens a KV budget holds (the CPU's path only: the Triton kernels keep one dtype). "auto": bfloat16
# for a block-quantized model on the CPU's path (`tierserve bench quant`: the Q4_1 default's next-token
# choices agree with float32 K/V's at 0.9964 of positions, perplexity ratio 0.9997; a 32-stream decode
# step 12% faster on the 2-core Zen 5), else the model's dtype.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
QUANTIZATIONS = ("none", "int8", "int4")


@dataclass(slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL_PATH  # the embedded model from its Q4_1 GGUF; "default": its float weights
    dtype: str = "auto"
    device: str = "auto"  # auto, cpu, cuda or cuda:N; auto: cuda when there is one (worker/devices.py)
    # None: 1 GiB on CPU; on CUDA what gpu_memory_utilization leaves after the weights and a warm-up
    # forward (worker/kv_budget.py)
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.9  # of the device's memory, in use once the KV cache is allocated
    num_kv_blocks: int | None = None  # overrides kv_cache_gb (tests use it to force preemption)
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_threads: int | None = None
    kernel_backend: str = "auto"
    cpu_kernels: bool = True  # our C kernels where the CPU probe allows (models/cpu_linear.py, cpu_decode.py)
    quant_activations: str = "int16"  # block-quantized linears: x in int16 or int8 blocks (models/quant.py)
    quantization: str = "none"  # a float checkpoint's linears quantized at load (models/quant.py)
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    # modules of a quantized model kept in float (wire/full_precision.py), e.g. ("attention", "lm_head")
    keep_full_precision: tuple[str, ...] = ()
    # decode-only steps replay CUDA graphs (batch-size buckets); None: on with CUDA + Triton, else off
    cuda_graphs: bool | None = None
    # This engine's share of a tensor-parallel model (worker/models/tensor_parallel.py): its rank among
    # tensor_parallel_size ranks, every one in torch.distributed's default group, set up by the caller.
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype: expected one of {DTYPE_CHOICES}, got {self.dtype!r}")
        check_device(self.device)
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb: must be positive, got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size: expected 8, 16 or 32, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be at least 2, got {self.max_model_len}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: expected one of {QUANTIZATIONS}, got {self.quantization!r}")
        try:
            self.keep_full_precision = check_entries(self.keep_full_precision)
        except ValueError as exc:
            raise ValueError(f"keep_full_precision: {exc}") from None
        if self.quant_activations not in QUANT_ACTIVATIONS:
            raise ValueError(
                f"quant_activations: expected one of {QUANT_ACTIVATIONS}, got {self.quant_activations!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"kernel_backend: expected one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}"
            )
        if not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            last = self.tensor_parallel_size - 1
            raise ValueError(f"tensor_parallel_rank {self.tensor_parallel_rank} is not in 0..{last}")
        if self.cuda_graphs and (self.device == "cpu" or self.kernel_backend == "torch"):
            raise ValueError(
                f"cuda_graphs: needs a cuda device and the Triton kernels (device={self.device!r}, "
                f"kernel_backend={self.kernel_backend!r})"
            )

    def context_limit(self, max_position_embeddings: int) -> int:
        """The longest sequence (prompt + output) the engine serves: the model's own limit, capped by
        ``max_model_len`` when that is set."""
        return min(max_position_embeddings, self.max_model_len or max_position_embeddings)

    def kv_torch_dtype(self, model_dtype: torch.dtype, triton: bool, quantized: bool) -> torch.dtype:
        """The KV cache's dtype for a model computing in ``model_dtype`` on the Triton kernels or the
        CPU's torch path (``quantized``: block-quantized linears); ``ValueError`` for a pair the kernels
        do not take (Triton's keep one dtype; a bf16 model over a float32 cache)."""
        if self.kv_cache_dtype == "auto":
            cpu_quantized = quantized and not triton and model_dtype == torch.float32
            return torch.bfloat16 if cpu_quantized else model_dtype
        kv = DTYPES[self.kv_cache_dtype]
        if kv != model_dtype and (triton or model_dtype != torch.float32):
            where = "on the Triton kernels" if triton else f"under a {model_dtype} model"
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} {where}; another dtype than the model's is for "
                "float32 models on CPU (a bfloat16 cache under float32 activations)"
            )
        return kv

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is not chosen yet: build through worker.precision.resolve_dtype")
        return DTYPES[self.dtype]
