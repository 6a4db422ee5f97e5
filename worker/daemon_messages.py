"""What a worker tells its gateways, built from its engine's state: ``Register`` (once a link is up),
``WorkerStats`` (every heartbeat and step) and a request's ``TokenDelta`` (every step it advanced in).

The daemon (``worker/daemon.py``) decides when each goes out and to which gateway; this module owns how
the engine's figures map onto the wire's fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from policies.feasibility import StepFloor
from wire.messages import MAX_MESSAGE_CHARS, Register, TokenDelta, TokenLogprob, Usage, WorkerStats
from worker.devices import describe_device
from worker.engine import Engine
from worker.models.store import DEFAULT_MODEL, DEFAULT_MODEL_ALIASES, QUANTIZED_DEFAULT_ALIASES
from worker.outputs import RequestOutput
from worker.sampler import TokenLogprobs


def model_name_of(model: str) -> str:
    """The name a worker announces for its model path: the embedded model's aliases are one name."""
    return DEFAULT_MODEL if model in DEFAULT_MODEL_ALIASES + QUANTIZED_DEFAULT_ALIASES else Path(model).name


def token_delta(output: RequestOutput, epoch: int) -> TokenDelta:
    """A step's output for one request as the gateway sees it (its usage counted as the client does:
    ``RequestOutput``)."""
    return TokenDelta(
        request_id=output.request_id,
        epoch=epoch,
        token_ids=output.new_token_ids,
        text=output.text_delta,
        logprobs=_wire_logprobs(output.logprobs),
        prompt_logprobs=_wire_logprobs(output.prompt_logprobs),
        prompt_position=output.prompt_position,
        finish_reason=output.finish_reason.value if output.finish_reason is not None else None,
        stop_reason=output.stop_reason,
        error=output.error[:MAX_MESSAGE_CHARS] if output.error is not None else None,
        usage=Usage(
            prompt_tokens=output.num_prompt_tokens,
            completion_tokens=output.num_output_tokens,
            cached_tokens=output.num_cached_tokens,
        ),
    )


def _wire_logprobs(entries: Sequence[TokenLogprobs]) -> list[TokenLogprob] | None:
    return [
        TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=lp.top, rank=lp.rank) for lp in entries
    ] or None


def worker_stats(engine: Engine, step_time_ema_ms: float, num_steps: int, kv_events_seq: int) -> WorkerStats:
    stats = engine.stats()
    return WorkerStats(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        step_time_ema_ms=step_time_ema_ms,
        num_steps=num_steps,
        num_preemptions=stats.num_preemptions,
        num_evictions=stats.num_evictions,
        num_prefix_query_tokens=stats.num_prefix_query_tokens,
        num_prefix_hit_tokens=stats.num_prefix_hit_tokens,
        kv_events_seq=kv_events_seq,
    )


def register(
    engine: Engine,
    worker_id: str,
    model_name: str,
    context_classes: Sequence[str],
    step_floor: StepFloor | None,
    pid: int,
) -> Register:
    """``context_classes``: what the worker serves (empty: every class); ``step_floor``: what
    worker/calibrate.py measured, if it ran."""
    config = engine.config
    num_blocks = engine.kv_cache.pool.num_blocks
    device = describe_device(engine.runner.device)
    return Register(
        worker_id=worker_id,
        model=model_name,
        dtype=config.dtype,
        device=str(engine.runner.device),
        num_kv_blocks=num_blocks,
        block_size=config.block_size,
        kv_capacity_tokens=num_blocks * config.block_size,
        max_model_len=engine.max_model_len,
        max_num_seqs=config.max_num_seqs,
        vocab_size=engine.model_config.vocab_size,
        context_classes=list(context_classes),
        quant_layer_errors=dict(engine.quant_layer_errors),
        device_name=device.name,
        device_memory_bytes=device.memory_bytes,
        step_floor_ms=step_floor.decode_ms if step_floor else None,
        prefill_ms_per_token=step_floor.prefill_ms_per_token if step_floor else None,
        pid=pid,
    )
