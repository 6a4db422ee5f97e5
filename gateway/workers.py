"""The worker registry: who is connected, what each serves, how loaded it is, and what it is running.

Pure bookkeeping, no sockets and no clock of its own: the dispatcher feeds it the messages workers send
(Register, Heartbeat, DrainNotice) with the arrival time, and asks it whom to send the next request to:
the ready workers of the model, shown as read-only views to the routing policy (policies/routing.py).
What each worker runs is read from the dispatcher's in-flight table (gateway/in_flight.py), its one owner.

    Register ──▶ READY ──DrainNotice──▶ DRAINING
                   │                        │
                   ├── no message for timeout_s (expire) ───────────────┐
                   └── work but no step for hang_timeout_s (expire_hung) ┴─▶ DEAD
    DEAD ──any message that revives (below)──▶ READY

Liveness is judged by arrival on the gateway's monotonic clock, never by ``Heartbeat.sent_at``
(wall clocks do not compare across hosts). Progress is judged by ``WorkerStats.num_steps``: the engine
thread publishes the stats, the socket thread heartbeats them, so a hung engine keeps heartbeating
with frozen stats, and a stopped process (SIGSTOP) stops heartbeating altogether. Readmission follows
the reason: a worker ejected for silence is back when it talks again (a heartbeat, or a Register of
the same process); one ejected for a hang only when a heartbeat shows a new step (or nothing to do),
since a hung engine keeps talking. A new process (Register with another pid) is always a fresh start.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from gateway.in_flight import InFlightTable
from gateway.prefix_index import PrefixIndex
from policies.base import NoParams
from policies.routing import LeastLoaded, RouteRequest, RoutingPolicy, WorkerStateName, WorkerView
from wire.block_hash import BlockHash, hash_blocks
from wire.messages import DrainNotice, Heartbeat, Register, WorkerStats


class WorkerState(enum.Enum):
    READY = "ready"
    DRAINING = "draining"  # finishing what it has, taking nothing new
    DEAD = "dead"  # silent or hung: ejected, its in-flight requests migrated (or failed)


_STATE_NAMES: dict[WorkerState, WorkerStateName] = {
    WorkerState.READY: "ready",
    WorkerState.DRAINING: "draining",
    WorkerState.DEAD: "dead",
}


@dataclass(frozen=True, slots=True)
class PromptKey:
    """What prefix matching needs of a request: its tokens (the prompt, then any tokens a migrated
    request resumes after: the new worker caches both) and the tenant's cache salt. Joined only when a
    prefix-aware policy hashes them, so the other policies' placements copy nothing."""

    prompt_token_ids: Sequence[int]
    resumed_token_ids: Sequence[int]
    cache_salt: str | None

    def token_ids(self) -> Sequence[int]:
        if not self.resumed_token_ids:
            return self.prompt_token_ids
        return [*self.prompt_token_ids, *self.resumed_token_ids]


@dataclass(frozen=True, slots=True)
class Pick:
    """The routing decision: the worker, and what was weighed (for the dispatch span)."""

    worker: WorkerInfo
    num_cached_tokens: int | None  # the chosen worker's expected prefix hit (prefix-aware policies)
    scores: Mapping[str, float]  # worker id → the policy's score, when it reports them


@dataclass(slots=True)
class WorkerInfo:
    """One worker as this gateway knows it. ``in_flight_ids`` are the requests *this* gateway sent it:
    a live, read-only view of the in-flight table."""

    worker_id: str
    register: Register
    last_seen: float  # monotonic arrival time of the last message of any kind
    in_flight_ids: AbstractSet[str]
    state: WorkerState = WorkerState.READY
    stats: WorkerStats | None = None  # from the last heartbeat; None until the first one
    heartbeat_seq: int | None = None
    # Monotonic time of the last heartbeat that showed a new engine step or nothing to do.
    progress_at: float = 0.0
    # Set when ejected for a hang: ``num_steps`` then; readmission needs a step past it.
    hung_at_step: int | None = None
    prefix: PrefixIndex = field(init=False)  # its prefix cache, from its KV events (stale until synced)

    def __post_init__(self) -> None:
        self.progress_at = self.last_seen
        self.prefix = PrefixIndex(self.register.block_size)

    @property
    def model(self) -> str:
        return self.register.model


def takes(info: WorkerInfo, context_class: str | None, num_prompt_tokens: int = 0) -> bool:
    """Whether ``info`` takes prompts of ``context_class`` (None: any) this long, with room to spare."""
    classes = info.register.context_classes
    is_class_ok = context_class is None or not classes or context_class in classes
    return is_class_ok and num_prompt_tokens < info.register.max_model_len


class RoutingError(Exception):
    """The routing policy chose no candidate (a bug in the policy)."""


class WorkerRegistry:
    """Every worker that ever registered (dead ones stay, so /metrics and a re-Register can see them)."""

    __slots__ = ("_in_flight", "_workers", "routing")

    def __init__(self, routing: RoutingPolicy | None = None, in_flight: InFlightTable | None = None) -> None:
        """``in_flight``: the dispatcher's table of what each worker runs (an empty one of its own when
        not given)."""
        self._workers: dict[str, WorkerInfo] = {}
        self._in_flight = in_flight if in_flight is not None else InFlightTable()
        # Whom ``pick`` sends a request to (the config's ``policies.routing``; least-loaded by default).
        self.routing: RoutingPolicy = routing if routing is not None else LeastLoaded(NoParams())

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[WorkerInfo]:
        return iter(list(self._workers.values()))

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def on_register(self, message: Register, now: float) -> set[str]:
        """Add a worker, or replace a known one's info; returns the request ids it has lost.

        A Register with a new pid is a new process: whatever the old one was running is gone (detached
        from it in the in-flight table, for the caller to fail or migrate). The same pid is a reconnect
        (the network blinked, or the gateway dropped the link): it still runs its requests and will keep
        sending their tokens, so they stay in flight (a worker we ejected stays DEAD until a heartbeat
        shows progress: its requests have already moved).
        """
        info = self._workers.get(message.worker_id)
        if info is None:
            in_flight_ids = self._in_flight.request_ids_on(message.worker_id)
            self._workers[message.worker_id] = WorkerInfo(message.worker_id, message, now, in_flight_ids)
            return set()
        lost: set[str] = set()
        is_new_process = info.register.pid != message.pid
        if is_new_process:
            lost = self._in_flight.detach(message.worker_id)
            info.stats = None
            info.heartbeat_seq = None
            info.hung_at_step = None
        info.register = message
        info.last_seen = now
        # Events may have been lost with the old link (or belong to the old process): start over.
        info.prefix = PrefixIndex(message.block_size, num_resyncs=info.prefix.num_resyncs)
        if is_new_process or info.state is not WorkerState.DEAD:
            info.state = WorkerState.READY
        elif info.hung_at_step is None:
            self._admit(info, now)  # ejected for silence, and talking again
        # (The same process dialling again after we ejected it for a hang must show a step first.)
        return lost

    def on_heartbeat(self, message: Heartbeat, now: float) -> WorkerInfo | None:
        """Record load and liveness; None for a worker that never registered (its heartbeat is ignored)."""
        info = self._workers.get(message.worker_id)
        if info is None:
            return None
        stats = message.stats
        is_idle = stats.num_running + stats.num_waiting == 0
        if is_idle or info.stats is None or stats.num_steps != info.stats.num_steps:
            info.progress_at = now
        info.stats = stats
        info.heartbeat_seq = message.seq
        info.last_seen = now
        if info.state is WorkerState.DEAD and (
            is_idle or info.hung_at_step is None or stats.num_steps > info.hung_at_step
        ):
            # It was stalled, not gone (or is stepping again): its old requests have moved elsewhere
            # (and were aborted here), but it can take new ones.
            self._admit(info, now)
        return info

    def on_drain(self, message: DrainNotice, now: float) -> WorkerInfo | None:
        info = self._workers.get(message.worker_id)
        if info is None:
            return None
        info.last_seen = now
        if info.state is not WorkerState.DEAD:
            info.state = WorkerState.DRAINING
        return info

    def touch(self, worker_id: str, now: float) -> WorkerInfo | None:
        """Any message proves a worker alive (a busy one's tokens arrive between its heartbeats)."""
        info = self._workers.get(worker_id)
        if info is not None and info.state is not WorkerState.DEAD:
            info.last_seen = now
        return info

    def view(
        self, info: WorkerInfo, num_cached_tokens: int | None = None, num_cached_blocks: int | None = None
    ) -> WorkerView:
        """``info`` as the routing and degradation policies see it (a copy: they cannot change it)."""
        stats = info.stats
        return WorkerView(
            worker_id=info.worker_id,
            model=info.model,
            state=_STATE_NAMES[info.state],
            max_num_seqs=info.register.max_num_seqs,
            num_in_flight=len(info.in_flight_ids),
            device=info.register.device,
            device_name=info.register.device_name,
            device_memory_bytes=info.register.device_memory_bytes,
            dtype=info.register.dtype,
            num_running=stats.num_running if stats is not None else None,
            num_waiting=stats.num_waiting if stats is not None else None,
            num_free_blocks=stats.num_free_blocks if stats is not None else None,
            num_total_blocks=stats.num_total_blocks if stats is not None else None,
            step_time_ema_ms=stats.step_time_ema_ms if stats is not None else None,
            num_cached_tokens=num_cached_tokens,
            num_cached_blocks=num_cached_blocks,
        )

    def ready(
        self,
        model: str,
        *,
        exclude: Collection[str] = (),
        context_class: str | None = None,
        num_prompt_tokens: int = 0,
    ) -> list[WorkerInfo]:
        """The ready workers serving ``model``, less ``exclude``, in registration order; with
        ``context_class``, only those that take that class and leave room after the prompt."""
        return [
            info
            for info in self._workers.values()
            if info.state is WorkerState.READY
            and info.model == model
            and info.worker_id not in exclude
            and takes(info, context_class, num_prompt_tokens)
        ]

    def pick(
        self,
        model: str,
        *,
        exclude: Collection[str] = (),
        request: RouteRequest | None = None,
        prompt: PromptKey | None = None,
    ) -> Pick | None:
        """The ready worker of ``model`` (not in ``exclude``) the routing policy chooses; None if there
        is none. A choice outside the candidates is the policy's bug: it raises, naming the policy.

        For a policy with ``uses_prefix_index``, each candidate's view carries how many of ``prompt``'s
        leading tokens its prefix index holds, and the chosen worker's index then expects the prompt's
        blocks (a burst sharing a new prefix follows the first request instead of scattering)."""
        if request is None:
            request = RouteRequest(request_id="", model=model, tier=None, num_prompt_tokens=0)
        candidates = self.ready(
            model,
            exclude=exclude,
            context_class=request.context_class,
            num_prompt_tokens=request.num_prompt_tokens,
        )
        if not candidates:
            return None
        hashes: dict[int, list[BlockHash]] = {}  # block size → the prompt's block hashes
        if prompt is not None and getattr(self.routing, "uses_prefix_index", False):
            token_ids = prompt.token_ids()
            for info in candidates:
                size = info.prefix.block_size
                if size not in hashes:
                    hashes[size] = hash_blocks(token_ids, size, prompt.cache_salt)
        cached = [
            info.prefix.match(hashes[info.prefix.block_size]) * info.prefix.block_size
            if hashes and info.prefix.is_fresh
            else None
            for info in candidates
        ]
        views = [
            self.view(info, num, info.prefix.num_blocks if num is not None else None)
            for info, num in zip(candidates, cached, strict=True)
        ]
        index = self.routing.choose(request, views)
        if not (isinstance(index, int) and 0 <= index < len(candidates)):
            name = type(self.routing).__name__
            raise RoutingError(f"routing policy {name} chose {index!r} among {len(candidates)} workers")
        chosen = candidates[index]
        if hashes:
            chosen.prefix.expect(hashes[chosen.prefix.block_size])
        scores = getattr(self.routing, "scores", None)
        return Pick(chosen, cached[index], dict(scores) if isinstance(scores, Mapping) else {})

    def expire(self, now: float, timeout_s: float) -> list[WorkerInfo]:
        """Mark workers silent for longer than ``timeout_s`` dead; returns the newly dead ones, their
        requests still on them in the in-flight table, for the caller to detach and fail or migrate."""
        newly_dead = []
        for info in self._workers.values():
            if info.state is not WorkerState.DEAD and now - info.last_seen > timeout_s:
                info.state = WorkerState.DEAD
                newly_dead.append(info)
        return newly_dead

    def expire_hung(self, now: float, hang_timeout_s: float) -> list[WorkerInfo]:
        """Mark dead the workers that still talk but have had requests and no engine step for longer
        than ``hang_timeout_s`` (by their heartbeats); returns the newly dead ones, as :meth:`expire`."""
        newly_dead = []
        for info in self._workers.values():
            stats = info.stats
            if (
                info.state is not WorkerState.DEAD
                and stats is not None
                and stats.num_running + stats.num_waiting > 0
                and now - info.progress_at > hang_timeout_s
            ):
                info.state = WorkerState.DEAD
                info.hung_at_step = stats.num_steps
                newly_dead.append(info)
        return newly_dead

    @staticmethod
    def _admit(info: WorkerInfo, now: float) -> None:
        # A fresh grace period: stats from before the ejection must not eject it again at once.
        info.state = WorkerState.READY
        info.hung_at_step = None
        info.progress_at = now

    def num_in_state(self, state: WorkerState, model: str | None = None) -> int:
        return sum(1 for w in self._workers.values() if w.state is state and model in (None, w.model))
