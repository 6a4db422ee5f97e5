"""The messages gateway and workers exchange over ZeroMQ: two tagged unions of msgspec Structs.

    worker ── Register, TokenBatch, Heartbeat, DrainNotice, Rejected, ──▶ gateway   (WorkerMessage)
              KVEvents, KVSnapshot
    worker ◀── Submit, Abort, Shutdown, ResyncKV ───────────────────────── gateway   (GatewayMessage)

Every message is a msgpack map whose ``type`` key names the Struct and whose ``v`` key carries
:data:`PROTOCOL_VERSION`, so a receiver can tell "another version" from "garbage" (see ``wire.codec``).

The ``Meta`` caps bound what a hostile but well-formed frame can make a receiver allocate; they are
checked on decode only. They are memory caps, not request validation: a Submit a user could get wrong
(empty prompt, token id outside the vocabulary) must still decode, so the worker can answer it with a
:class:`Rejected` instead of dropping it silently and leaving the gateway waiting.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

import msgspec

from wire.errors import InvalidRequestError
from wire.prompt import check_prompt
from wire.sampling import MAX_TOP_LOGPROBS, SamplingParams
from wire.tier import Tier

PROTOCOL_VERSION = 1

MAX_ID_CHARS = 256  # request, worker ids and cache salts
MAX_NAME_CHARS = 1024  # model names, dtypes, devices, reasons
MAX_MESSAGE_CHARS = 16 * 1024  # human-readable error text
MAX_PROMPT_TOKENS = 1 << 20
MAX_DELTA_TOKENS = 4096  # tokens one request gains in one step (speculative decoding stays far below)
MAX_DELTA_TEXT_CHARS = 1 << 20
MAX_DELTAS_PER_BATCH = 4096  # an engine with more running requests splits its TokenBatch
MAX_QUANT_LAYERS = 4096  # quantized linears a Register reports errors for
MAX_KV_HASHES = 1 << 18  # block hashes in one KVEvents/KVSnapshot (16 bytes each: 4 MiB)
MAX_TRACE_ENTRIES = 8
MAX_PRIORITY = (1 << 31) - 1  # vLLM's ``priority`` body field, bounded to a 32-bit int
MAX_TRACE_VALUE_CHARS = 1024  # W3C tracestate is at most 32 members of ~256 chars; 512 in practice

Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_MESSAGE_CHARS)]
TraceKey = Annotated[str, msgspec.Meta(max_length=64)]
TraceValue = Annotated[str, msgspec.Meta(max_length=MAX_TRACE_VALUE_CHARS)]

FinishReason: TypeAlias = Literal["stop", "length", "abort", "error"]


class _Message(msgspec.Struct, tag_field="type", frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Not ``omit_defaults``: ``v`` must always be on the wire, or a peer of another version would read
    # a missing ``v`` as its own default.
    v: int = PROTOCOL_VERSION


# ---------------------------------------------------------------- worker → gateway


class Register(_Message, tag="register", frozen=True, kw_only=True):
    """A worker introducing itself (first message on a connection, and again after a reconnect)."""

    worker_id: Id
    model: Name
    dtype: Name
    device: Name
    num_kv_blocks: int
    block_size: int
    kv_capacity_tokens: int  # num_kv_blocks * block_size, sent so the gateway need not know the layout
    max_model_len: int
    max_num_seqs: int  # sequences it runs at once: the gateway's admission counts seats from it
    vocab_size: int | None = None
    # The gateway's context classes (gateway.context_classes) it takes; empty: every class.
    context_classes: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
    # A quantized model's linears: each one's output error against its exact weight, measured at load
    # (worker/models/quant_check.py); empty for a float model.
    quant_layer_errors: Annotated[dict[Name, float], msgspec.Meta(max_length=MAX_QUANT_LAYERS)] = {}
    # What it computes on, for policies that tell a fast worker from a slow one: the GPU's name and
    # total memory, or the CPU's model name and None. None from a worker that predates them.
    device_name: Name | None = None
    device_memory_bytes: int | None = None
    # Measured once at start, alone (worker/calibrate.py): a one-decode step, a prefill per token.
    # None from a worker that did not measure (policies/feasibility.py says what they decide).
    step_floor_ms: float | None = None
    prefill_ms_per_token: float | None = None
    pid: int


class Usage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Cumulative token counts for one request, as OpenAI's ``usage`` reports them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class TokenLogprob(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """The chosen token's logprob and, when asked for, the top alternatives as (token_id, logprob); a
    scored prompt token's rank among the vocabulary (1: the most likely)."""

    token_id: int
    logprob: float
    top: Annotated[list[tuple[int, float]], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)] = []
    rank: int | None = None


class TokenDelta(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """What one request gained in one engine step.

    ``epoch`` echoes the Submit's, so the gateway drops late tokens from a worker it has already
    failed over from. ``usage`` is cumulative and present on every delta, so the final one needs no
    special case. ``omit_defaults``: most deltas carry no logprobs and no error; this is the hot path.
    """

    request_id: Id
    epoch: int
    token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_DELTA_TOKENS)] = []
    text: Annotated[str, msgspec.Meta(max_length=MAX_DELTA_TEXT_CHARS)] = ""
    logprobs: Annotated[list[TokenLogprob], msgspec.Meta(max_length=MAX_DELTA_TOKENS)] | None = None
    # A scored prompt's (``SamplingParams.prompt_logprobs``): the logprobs of its tokens from position
    # ``prompt_position`` on (1 or more: the first token has none), a prefill chunk's worth a delta,
    # before the first token's. A request moved to another worker is scored again from position 1.
    prompt_logprobs: Annotated[list[TokenLogprob], msgspec.Meta(max_length=MAX_DELTA_TOKENS)] | None = None
    prompt_position: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: Text | int | None = None  # vLLM's: the stop string or stop token id that ended it
    error: Text | None = None  # set with finish_reason "error": our fault, logged, 500 for this request
    usage: Usage


class TokenBatch(_Message, tag="token_batch", frozen=True, kw_only=True):
    """Everything one engine step produced, for all requests that produced something."""

    worker_id: Id
    step: int
    deltas: Annotated[list[TokenDelta], msgspec.Meta(max_length=MAX_DELTAS_PER_BATCH)]


class WorkerStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Load the router weighs and the health check watches (``num_steps`` must keep growing)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    step_time_ema_ms: float
    num_steps: int
    num_preemptions: int
    # Cumulative since the worker started (counters for /metrics; a restart starts them again at 0).
    num_evictions: int = 0  # cached prefix blocks reused for other KV
    num_prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int = 0  # of those, the ones found cached
    kv_events_seq: int = -1  # the last KVEvents.seq sent (-1: none yet); the gateway's index checks it


class Heartbeat(_Message, tag="heartbeat", frozen=True, kw_only=True):
    """Periodic liveness + load. ``sent_at`` is wall-clock (``time.time()``): monotonic clocks do not
    compare across hosts; the gateway uses it only to log skew, and judges liveness by arrival."""

    worker_id: Id
    seq: int
    sent_at: float
    stats: WorkerStats


BlockHashes = Annotated[list[bytes], msgspec.Meta(max_length=MAX_KV_HASHES)]


class KVEvents(_Message, tag="kv_events", frozen=True, kw_only=True):
    """How a worker's prefix cache changed since its previous KVEvents: the block hashes
    (wire.block_hash, salted per tenant) it now holds, and those it evicted. One per engine step that
    changed anything; a hash appears in at most one of the two lists (its state at the end of the step).

    ``seq`` counts KVEvents from 0 in each worker process, one by one: a gateway that sees a gap has
    missed some and asks for a :class:`KVSnapshot` (:class:`ResyncKV`) instead of trusting its index.
    """

    worker_id: Id
    seq: int
    block_size: int
    stored: BlockHashes = []
    removed: BlockHashes = []


class KVSnapshot(_Message, tag="kv_snapshot", frozen=True, kw_only=True):
    """Every block hash a worker's prefix cache holds, as of its KVEvents number ``seq`` (-1: before
    the first), in ``num_parts`` consecutive messages (``part`` counts from 0). The answer to
    :class:`ResyncKV`; the parts are sent back to back, before any later KVEvents."""

    worker_id: Id
    seq: int
    block_size: int
    part: int
    num_parts: int
    hashes: BlockHashes = []


class DrainNotice(_Message, tag="drain_notice", frozen=True, kw_only=True):
    """The worker stops taking Submits (SIGTERM, Shutdown(drain=True)); in-flight requests finish."""

    worker_id: Id
    reason: Name


class Rejected(_Message, tag="rejected", frozen=True, kw_only=True):
    """The worker refused a Submit; the gateway answers the client with ``status`` (a 4xx, or 503 when
    draining) and a message naming ``field``, as :class:`wire.errors.InvalidRequestError` does."""

    request_id: Id
    epoch: int
    status: int
    field: Name
    message: Text


# ---------------------------------------------------------------- gateway → worker


class Submit(_Message, tag="submit", frozen=True, kw_only=True):
    """Run one request.

    ``epoch`` counts attempts at the same ``request_id``: after a failover the gateway re-submits with
    a higher epoch and ``resumed_token_ids`` (output the client has already seen). The worker treats
    those as already generated (penalties, stop checks, ``max_tokens``, usage) and emits only what
    follows them, so the client's stream continues with nothing lost and nothing repeated.
    """

    request_id: Id
    epoch: int
    prompt_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
    resumed_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)] = []
    sampling: SamplingParams
    tier: Tier
    cache_salt: Id | None = None  # from the tenant: isolates prefix caches (wire.block_hash)
    tenant: Id | None = None  # who asked (fairness policies); never client-chosen
    # Within the tier, lower runs first (vLLM's ``priority``); the tier always comes first.
    priority: Annotated[int, msgspec.Meta(ge=-MAX_PRIORITY - 1, le=MAX_PRIORITY)] = 0
    trace_context: Annotated[dict[TraceKey, TraceValue], msgspec.Meta(max_length=MAX_TRACE_ENTRIES)] = {}
    arrival_time: float  # wall-clock at the gateway, for queue-time metrics and deadlines

    def validate(self, *, vocab_size: int, max_model_len: int) -> None:
        """Raise :class:`InvalidRequestError` naming the first field the worker cannot run."""
        check_prompt(self.prompt_token_ids, vocab_size=vocab_size, max_model_len=max_model_len)
        self.sampling.validate(
            vocab_size=vocab_size, max_model_len=max_model_len, num_prompt_tokens=len(self.prompt_token_ids)
        )
        if self.resumed_token_ids and len(self.resumed_token_ids) >= self.sampling.max_tokens:
            raise InvalidRequestError(
                "resumed_token_ids",
                f"{len(self.resumed_token_ids)} tokens already generated of max_tokens "
                f"{self.sampling.max_tokens}: nothing left to run",
            )


class Abort(_Message, tag="abort", frozen=True, kw_only=True):
    """Stop a request (client gone, or failed over): free its blocks, emit nothing more for it.

    Only the matching ``epoch`` is aborted, so a late Abort never kills the newer attempt."""

    request_id: Id
    epoch: int


class Shutdown(_Message, tag="shutdown", frozen=True, kw_only=True):
    """Stop the worker. ``drain``: finish in-flight requests first (and send DrainNotice); otherwise
    abort them (finish_reason "abort") and exit."""

    drain: bool = True


class ResyncKV(_Message, tag="resync_kv", frozen=True, kw_only=True):
    """Send me a :class:`KVSnapshot`: the gateway's index of this worker's cache is stale (a gap in
    KVEvents, a restart, or a new link)."""


WorkerMessage: TypeAlias = Register | TokenBatch | Heartbeat | DrainNotice | Rejected | KVEvents | KVSnapshot
GatewayMessage: TypeAlias = Submit | Abort | Shutdown | ResyncKV
Message: TypeAlias = WorkerMessage | GatewayMessage
