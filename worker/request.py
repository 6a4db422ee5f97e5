"""A request inside the engine: it owns its tokens, counters and block table."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wire.block_hash import BlockHash
from wire.sampling import SamplingParams

if TYPE_CHECKING:
    from worker.kv_cache.block_pool import KVBlock


# Prompt tokens a step computes at most of a request whose prompt is scored (``scores_prompt``): each
# row's logits, ``vocab_size`` floats, come back with the step (256 rows of a 49,152-token vocabulary:
# 50 MB), and their logprobs go out a chunk at a time.
SCORE_CHUNK_TOKENS = 256


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the client went away or the engine dropped it
    ERROR = "error"  # our mistake, confined to this request


@dataclass(slots=True, frozen=True)
class TierRef:
    """The SLA tier a request runs under; rank 0 is the most urgent; None targets mean none."""

    name: str = "standard"
    rank: int = 1
    ttft_ms: float | None = None
    tpot_ms: float | None = None


@dataclass(slots=True, eq=False)  # an entity: equal only to itself
class Request:
    """One sequence being generated.

    Invariants: ``num_computed_tokens <= num_tokens``; the KV of the first
    ``num_computed_tokens`` tokens lives in ``blocks`` (its block table; ``block_ids`` their ids,
    what the runner reads), the first ``num_published_blocks`` of them in the prefix cache;
    ``block_hashes`` covers the full blocks of ``all_token_ids`` hashed so far.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    tier: TierRef = field(default_factory=TierRef)
    cache_salt: str | None = None
    tenant: str | None = None
    priority: int = 0  # within the tier, lower first (vLLM's ``priority``)
    arrival_time: float = field(default_factory=time.monotonic)
    # The prompt's last tokens that another worker generated (a failover's continuation): computed
    # and cached as the output tokens they were (``outputs_from``), so the answer goes on in the same bits.
    num_resumed: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    first_token_time: float | None = None  # the scheduler's clock when the first token was due
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    blocks: list[KVBlock] = field(default_factory=list)  # owned, in block-table order (kv_cache/)
    block_ids: list[int] = field(default_factory=list)  # the ids of ``blocks``
    num_published_blocks: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def outputs_from(self) -> int:
        """The position of the first token a model generated (here, or resumed): the tokens before it
        are the client's prompt, computed as prompt rows; from it on, as output rows."""
        return len(self.prompt_token_ids) - self.num_resumed

    @property
    def resumed_token_ids(self) -> list[int]:
        """The prompt's tail another worker generated (empty unless resumed after a failover)."""
        return self.prompt_token_ids[self.outputs_from :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt tokens' logprobs are still to be computed (``prompt_logprobs`` asked for,
        no token generated yet): its prompt is then computed whole, not read from the prefix cache,
        in chunks of at most ``SCORE_CHUNK_TOKENS``. A failover's continuation was scored before."""
        asked = self.sampling_params.prompt_logprobs is not None
        return asked and not self.output_token_ids and not self.num_resumed

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    # ---- what policies see (policies.base.SeqView) ----

    @property
    def tier_name(self) -> str:
        return self.tier.name

    @property
    def tier_rank(self) -> int:
        return self.tier.rank

    @property
    def tpot_ms(self) -> float | None:
        return self.tier.tpot_ms

    @property
    def ttft_deadline(self) -> float | None:
        ttft_ms = self.tier.ttft_ms
        return None if ttft_ms is None else self.arrival_time + ttft_ms / 1e3

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
