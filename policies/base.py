"""What a policy is: one Protocol per kind, the read-only views it decides on, and its invariants.

    kind         where it runs   decides                                     built-ins
    ordering     worker          the order waiting (and running) requests    fcfs, tiered
                                 are considered in each step
    budget       worker          how many tokens and sequences one step      static, slo-budget
                                 may hold
    preemption   worker          which running request gives its KV back     newest, lowest-tier
    eviction     worker          which free cached block is reused first     lru, priority-weighted
    admission    gateway         admit, queue or shed (with Retry-After)     bounded-queue
    routing      gateway         which worker runs a request                 least-loaded, round-robin,
                                                                             prefix-load
    degradation  gateway         primary or fallback model pool              never, degrade-on-slo

A policy sees views and returns a choice; it never mutates what it is shown, holds no reference to
engine objects after it returns, and must not block (it runs inside the engine's step or on the
gateway's event loop). Pure Python: no torch, nothing from worker/ or gateway/.

Every policy class has a ``kind`` and a ``Params`` msgspec Struct (its typed parameters, decoded from
the config's ``params`` table with unknown keys refused) and is built as ``cls(params)``. See
``policies.registry`` for how names resolve and ``docs/policies.md`` for a walkthrough.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, runtime_checkable

import msgspec

from policies.step_time import StepTimeLimit

PolicyKind = Literal["ordering", "budget", "preemption", "eviction", "admission", "routing", "degradation"]
POLICY_KINDS: tuple[PolicyKind, ...] = (
    "ordering",
    "budget",
    "preemption",
    "eviction",
    "admission",
    "routing",
    "degradation",
)


class NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """For policies without parameters: any key in ``params`` is an error."""


# ---------------------------------------------------------------- views (what a worker policy sees)


class SeqView(Protocol):
    """One request inside a worker, read-only. ``tier_rank`` 0 is the most urgent."""

    @property
    def request_id(self) -> str: ...
    @property
    def tier_name(self) -> str: ...
    @property
    def tier_rank(self) -> int: ...
    @property
    def tpot_ms(self) -> float | None:
        """The tier's time-per-output-token target; None for no target."""
        ...

    @property
    def ttft_deadline(self) -> float | None:
        """Monotonic time by which the first token is due (arrival + the tier's TTFT); None for none."""
        ...

    @property
    def first_token_time(self) -> float | None:
        """Monotonic time the first output token was computed (the start of the TPOT clock); None
        before it. Kept through a preemption."""
        ...

    @property
    def tenant(self) -> str | None: ...
    @property
    def priority(self) -> int:
        """Within the tier, lower goes first (vLLM's ``priority`` body field; default 0)."""
        ...

    @property
    def arrival_time(self) -> float: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int:
        """Prompt + output so far: the context the next step attends over."""
        ...

    @property
    def num_computed_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The engine's configured ceilings, which a budget may lower but never raise, and the
    scheduler's clock (monotonic seconds, as ``arrival_time`` and ``ttft_deadline``) at this step."""

    max_num_batched_tokens: int
    max_num_seqs: int
    now: float


@dataclass(frozen=True, slots=True)
class StepBudget:
    """What one step may hold. ``max_num_tokens`` counts new tokens (a decode is 1, a prefill chunk
    its length); ``time_limit``, when set, caps the step's predicted time as well (policies.step_time).
    Requests that do not fit wait for a later step (a running request keeps its KV)."""

    max_num_tokens: int
    max_num_seqs: int
    time_limit: StepTimeLimit | None = None


@dataclass(frozen=True, slots=True)
class StepReport:
    """What a finished step cost, for budgets that learn: new tokens (``num_decodes`` of them
    single-token requests, the rest prefill), context attended, time."""

    num_tokens: int
    num_seqs: int
    num_context_tokens: int  # sum over scheduled requests of their context after the step
    elapsed_ms: float
    num_decodes: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes


@dataclass(frozen=True, slots=True)
class EvictionCandidate:
    """The least recently used free cached block of one tier (``tier_rank``), as eviction sees it."""

    tier_rank: int
    last_used: float  # monotonic time it was last part of a running request


# ---------------------------------------------------------------- worker kinds


@runtime_checkable
class OrderingPolicy(Protocol):
    """The order requests are considered in each step.

    Invariant: ``order`` returns a permutation of its input (every request exactly once). The scheduler
    serves running requests in this order under the step budget (those that do not fit wait), then
    admits waiting ones in this order while blocks and budget last.
    """

    kind: ClassVar[str]

    def order(self, requests: Sequence[SeqView], now: float) -> list[SeqView]: ...


@runtime_checkable
class SlotSharing(Protocol):
    """What an ordering may add (optional): a waiting request's claim on a sequence slot when every
    slot is taken by its own tier (a less urgent tier always gives way, whatever the ordering).

    ``slot_donors`` returns the running requests the waiting ``request`` may take a slot from (empty:
    it waits for one to free); the preemption policy picks one of them and it is recomputed later
    (its full blocks stay cached, so little is lost). Invariant: a request that took a slot is never
    a donor to the request it took it from, at any later step with nothing else changed (no two
    requests take each other's slot back and forth).
    """

    def slot_donors(
        self, request: SeqView, running: Sequence[SeqView], waiting: Sequence[SeqView], max_num_seqs: int
    ) -> list[SeqView]: ...


@runtime_checkable
class BudgetPolicy(Protocol):
    """The size of each step.

    Invariants: ``1 <= max_num_tokens <= limits.max_num_batched_tokens`` and
    ``1 <= max_num_seqs <= limits.max_num_seqs`` (the engine never exceeds its configuration, and a
    step always makes progress). ``observe`` is told the cost of every step that ran.
    """

    kind: ClassVar[str]

    def budget(
        self, running: Sequence[SeqView], waiting: Sequence[SeqView], limits: StepLimits
    ) -> StepBudget: ...

    def observe(self, report: StepReport) -> None: ...


@runtime_checkable
class PreemptionPolicy(Protocol):
    """Which running request is preempted (its blocks freed, recomputed later) when the KV cache is full.

    Invariant: returns one element of ``candidates`` (never empty). The request that needs the blocks
    is among them: choosing it means it waits instead.
    """

    kind: ClassVar[str]

    def victim(self, candidates: Sequence[SeqView]) -> SeqView: ...


@runtime_checkable
class EvictionPolicy(Protocol):
    """Which free cached block is reused when a new block is needed.

    Shown the least recently used free cached block of each tier that has one (never empty); returns
    the index of the one to evict. Invariant: only free blocks (no running request holds them) are ever
    candidates, so eviction changes speed, never output.
    """

    kind: ClassVar[str]

    def choose(self, candidates: Sequence[EvictionCandidate], now: float) -> int: ...
