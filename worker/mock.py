"""``--mock``: the real Engine, Scheduler and KV cache around a simulated model (a test double).

Gateway, routing and failover tests run fleets of workers on a couple of cores, so the model is
replaced by three small pieces:

- :class:`MockTokenizer`: byte-level, so any text round-trips and a multi-byte character spans
  several tokens (the detokenizer's hold-back runs for real);
- :class:`MockModel`: the next token is a pure function of the whole context so far, so greedy output
  depends only on the prompt, and resubmitting prompt + generated tokens continues the same transcript;
- :class:`MockCost`: how long a step "takes", slept on the engine thread (busy, but the GIL is free).

Token ids::

    0 <|end|> (eos)   1 <|begin|> (bos)   2 <|pad|>   3 <|header|>   4 + b  byte b (0..255)
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels.sampling import TORCH_SAMPLING, SamplingOps
from wire.byte_tokenizer import BOS_ID, BYTE_OFFSET, EOS_ID, VOCAB_SIZE, ByteTokenizer
from worker.config import EngineConfig
from worker.engine import Engine
from worker.models.config import ModelConfig
from worker.policy_set import WorkerPolicies
from worker.request import Request
from worker.scheduler import SchedulerOutput

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "VOCAB_SIZE",
    "MockCost",
    "MockModel",
    "MockRunner",
    "MockTokenizer",
    "build_mock_engine",
    "mock_model_config",
]

# The tokenizer lives in wire/ so the gateway can build mock prompts without importing the worker.
MockTokenizer = ByteTokenizer


@dataclass(slots=True, frozen=True)
class MockModel:
    """The next token as a pure function of the context (prompt + everything generated so far).

    ``h`` = the first 8 bytes of BLAKE2b over the context as little-endian uint32s, so the same
    context gives the same token on any machine, in any process, in any batch. From ``h``:

    - the context ends inside a UTF-8 character: its next continuation byte;
    - else with probability ``eos_rate``: EOS;
    - else with probability ``multibyte_rate``: the lead byte of a 3-byte CJK character;
    - else a printable ASCII byte (0x20..0x7E).
    """

    eos_rate: float = 0.0
    multibyte_rate: float = 1 / 16

    def __post_init__(self) -> None:
        if not (0.0 <= self.eos_rate <= 1.0 and 0.0 <= self.multibyte_rate <= 1.0):
            raise ValueError(f"eos_rate and multibyte_rate must be in [0, 1], got {self}")

    def next_token_id(self, context: Sequence[int]) -> int:
        digest = hashlib.blake2b(struct.pack(f"<{len(context)}I", *context), digest_size=8).digest()
        h = int.from_bytes(digest, "little")
        if _pending_continuations(context):
            return BYTE_OFFSET + 0x80 + h % 0x40
        u = (h >> 32) / 2**32  # high bits pick the kind, low bits the byte: independent
        if u < self.eos_rate:
            return EOS_ID
        if u < self.eos_rate + self.multibyte_rate:
            return BYTE_OFFSET + 0xE4 + h % 6  # leads E4..E9: every continuation pair is a valid character
        return BYTE_OFFSET + 0x20 + h % 95

    def transcript(self, prompt_token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """The greedy continuation, without an engine (stops after EOS, as the engine does)."""
        context = list(prompt_token_ids)
        for _ in range(num_tokens):
            context.append(self.next_token_id(context))
            if context[-1] == EOS_ID:
                break
        return context[len(prompt_token_ids) :]


def _pending_continuations(context: Sequence[int]) -> int:
    """How many UTF-8 continuation bytes the context still owes its last character (0 if none)."""
    num_continuations = 0
    for token_id in reversed(context[-4:]):
        byte = token_id - BYTE_OFFSET
        if byte < 0:
            return 0  # a special token: nothing to continue
        if byte & 0xC0 == 0x80:
            num_continuations += 1
            continue
        length = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return max(length - 1 - num_continuations, 0)
    return 0


@dataclass(slots=True, frozen=True)
class MockCost:
    """Step time = fixed + per scheduled token + per context token (the KV each request attends over).

    ``seconds = fixed_ms/1e3 + per_token_ms/1e3 * Σ new tokens + per_context_token_us/1e6 * Σ seq_len``
    where ``seq_len`` is a scheduled request's context length at the end of the step.
    """

    fixed_ms: float = 0.0
    per_token_ms: float = 0.0
    per_context_token_us: float = 0.0

    def __post_init__(self) -> None:
        if min(self.fixed_ms, self.per_token_ms, self.per_context_token_us) < 0:
            raise ValueError(f"mock cost terms must not be negative, got {self}")

    def step_seconds(self, num_new_tokens: int, num_context_tokens: int) -> float:
        return (
            self.fixed_ms / 1e3
            + self.per_token_ms / 1e3 * num_new_tokens
            + self.per_context_token_us / 1e6 * num_context_tokens
        )


@dataclass(slots=True)
class MockRunner:
    """A :class:`~worker.model_runner.StepRunner` with no model: logits peak on ``model``'s token."""

    block_size: int
    model: MockModel = field(default_factory=MockModel)
    cost: MockCost = field(default_factory=MockCost)
    # The chosen token's logit over 0 for the rest: p ≈ 0.99, so sampling at temperature 1 mostly agrees.
    peak_logit: float = 10.0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sampling: SamplingOps = TORCH_SAMPLING
    last_step_seconds: float = 0.0  # what the cost model charged the last step (slept, less our own work)
    num_steps: int = 0

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        start = time.monotonic()
        sampled: list[Request] = []
        token_ids: list[int] = []
        num_context_tokens = 0
        for request in out.scheduled:
            end = request.num_computed_tokens + out.num_scheduled_tokens[request.request_id]
            # The real runner would index past the block table; fail the same way on a scheduler bug.
            if len(request.block_ids) * self.block_size < end:
                raise RuntimeError(
                    f"{request.request_id}: {len(request.block_ids)} blocks cannot hold {end} tokens"
                )
            num_context_tokens += end
            if end == request.num_tokens:
                sampled.append(request)
                token_ids.append(self.model.next_token_id(request.all_token_ids))
        for span in out.score_spans:  # rows after the sampled ones
            tokens, first = span.request.all_token_ids, span.first_position
            predicts = range(first, first + span.num_rows)
            token_ids.extend(self.model.next_token_id(tokens[:p]) for p in predicts)
        self.last_step_seconds = self.cost.step_seconds(out.total_num_tokens, num_context_tokens)
        self.num_steps += 1
        logits = torch.zeros(len(token_ids), VOCAB_SIZE, dtype=torch.float32)
        if token_ids:
            logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = self.peak_logit
        # Sleep until the deadline, so the step lasts the modelled time however long the hashing took.
        remaining = start + self.last_step_seconds - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        return sampled, logits


def mock_model_config(max_model_len: int = 4096) -> ModelConfig:
    """What the engine reads of a model (vocabulary, eos, context); the shape fields are nominal."""
    return ModelConfig(
        architecture="MockForCausalLM",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=max_model_len,
        tie_word_embeddings=True,
        qkv_bias=False,
        eos_token_ids=(EOS_ID,),
        bos_token_id=BOS_ID,
        torch_dtype="float32",
    )


def build_mock_engine(
    config: EngineConfig,
    cost: MockCost | None = None,
    *,
    num_kv_blocks: int = 512,
    max_model_len: int = 4096,
    model: MockModel | None = None,
    policies: WorkerPolicies | None = None,
) -> Engine:
    """An Engine over :class:`MockRunner`; ``config.num_kv_blocks``, when set, wins over ``num_kv_blocks``."""
    runner = MockRunner(config.block_size, model or MockModel(), cost or MockCost())
    if config.dtype == "auto":
        config = dataclasses.replace(config, dtype="float32")  # the simulated model's logits
    return Engine(
        config,
        MockTokenizer(),
        runner,
        mock_model_config(max_model_len),
        config.num_kv_blocks or num_kv_blocks,
        policies,
    )
