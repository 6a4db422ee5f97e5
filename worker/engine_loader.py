"""What an engine runs on, loaded from its config: the model runner, the tokenizer and the KV blocks.

The config's ``auto`` fields are resolved here (the device, the dtype: quantized weights on a CPU
compute in float32), and a quantized model's linears are measured against their exact weights once,
at load (``quant_check``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from worker.config import EngineConfig
from worker.devices import resolve_device
from worker.model_runner import ModelRunner, StepRunner, build_model_runner
from worker.models.config import ModelConfig
from worker.models.gguf_model import is_gguf_folder
from worker.models.hf_quant import is_hf_quantized_folder
from worker.models.quant import is_quantized
from worker.models.quant_check import CALIBRATION_TEXT, check_at_load
from worker.models.store import resolve_model
from worker.precision import resolve_dtype

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    config: EngineConfig  # resolved: the device and dtype the model runs in
    tokenizer: Any
    runner: StepRunner
    model_config: ModelConfig
    num_kv_blocks: int
    quant_layer_errors: dict[str, float]  # each quantized linear's output error (empty: none quantized)


def load_model(config: EngineConfig) -> LoadedModel:
    """Load the model named by ``config.model`` (a folder, or the embedded default) and its tokenizer."""
    from transformers import AutoTokenizer

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    config = resolve_device(config)
    model_path = resolve_model(config.model)
    is_quantized_folder = is_gguf_folder(model_path) or is_hf_quantized_folder(model_path)
    quantized = is_quantized_folder or config.quantization != "none"
    if quantized and config.dtype == "auto" and config.device == "cpu":
        # quantized linears compute in float32 on CPU, and the fused decode layer takes a float32
        # cache (the Triton kernel on a GPU takes x in the model's dtype)
        log.info("dtype: float32 (quantized linears compute in float32)")
        config = dataclasses.replace(config, dtype="float32")
    config = resolve_dtype(config)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    runner, model_config, num_blocks = build_model_runner(config, model_path)
    errors: dict[str, float] = {}
    if isinstance(runner, ModelRunner) and is_quantized(runner.model):
        ids = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)
        errors = check_at_load(runner.model, ids)
    return LoadedModel(config, tokenizer, runner, model_config, num_blocks, errors)
