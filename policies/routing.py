"""Routing at the gateway: which ready worker of a model runs one request.

The gateway owns the mechanism (the registry of workers, liveness, re-trying another worker when a send
fails or a worker refuses while draining; gateway/workers.py, gateway/dispatch.py); a policy only
chooses, from :class:`WorkerView`s of the candidates, where one request goes.

Load comes from two places: ``num_in_flight`` is what this gateway has sent the worker and not seen
finish (current, but blind to other gateways sharing it); ``num_running``/``num_waiting``, the KV
blocks and the step-time average are the worker's own figures from its last heartbeat (complete, but as
old as that heartbeat). :attr:`WorkerView.num_load` combines them.

Prefix reuse comes from the gateway's index of each worker's prefix cache (gateway/prefix_index.py,
fed by the workers' KV events): a policy whose class sets ``uses_prefix_index = True`` gets
:attr:`WorkerView.num_cached_tokens`, how many of this prompt's tokens the worker is expected to hold.
A policy may also leave its last decision's ``scores`` (worker id → score) for traces to show.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, runtime_checkable

from policies.base import NoParams
from wire.tier import Tier

WorkerStateName = Literal["ready", "draining", "dead"]


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as routing sees it, read-only."""

    worker_id: str
    model: str  # the served model name it registered under
    state: WorkerStateName  # candidates are always "ready"; the field is there for views of a fleet
    max_num_seqs: int  # sequences it runs at once (from its Register)
    num_in_flight: int  # requests this gateway sent it that have not finished
    # Its device (from its Register): "cuda" or "cpu", the GPU's or CPU's name, a GPU's total memory
    # (None on CPU), and the dtype it computes in; a policy may weigh a fast worker against a slow one.
    device: str | None = None
    device_name: str | None = None
    device_memory_bytes: int | None = None
    dtype: str | None = None
    num_running: int | None = None  # from its last heartbeat; None before the first
    num_waiting: int | None = None
    num_free_blocks: int | None = None
    num_total_blocks: int | None = None
    step_time_ema_ms: float | None = None
    # Leading prompt tokens in its prefix cache, by the gateway's index; None when not asked for
    # (the policy does not set ``uses_prefix_index``) or the index is stale (being resynced).
    num_cached_tokens: int | None = None
    num_cached_blocks: int | None = None  # blocks in its prefix cache by the index (same conditions)

    @property
    def num_load(self) -> int:
        """Requests on the worker: the larger of what it last reported and what we have sent it.

        The report lags (a burst of submits between two heartbeats would otherwise all land on the
        worker that looked idle); our own count is current but blind to other gateways. The larger of
        the two is right in both cases.
        """
        reported = (self.num_running or 0) + (self.num_waiting or 0)
        return max(reported, self.num_in_flight)

    @property
    def num_queued(self) -> int:
        """Requests waiting on the worker for a running slot: reported, or implied by our own count."""
        return max(self.num_waiting or 0, self.num_load - self.max_num_seqs, 0)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use at the last heartbeat (0 before the first)."""
        if self.num_total_blocks is None or self.num_free_blocks is None or self.num_total_blocks <= 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The request being placed. ``tier`` is None only for callers outside the request path (tests)."""

    request_id: str
    model: str
    tier: Tier | None
    num_prompt_tokens: int
    context_class: str | None = None  # gateway.context_classes: candidates all take this class


@runtime_checkable
class RoutingPolicy(Protocol):
    """Choose the worker for one request.

    Invariants: ``candidates`` is never empty, and holds only ready workers of ``request.model`` that
    the gateway may use now (workers it already tried for this request are left out); ``choose``
    returns an index into it. It is called once per placement attempt on the event loop, so it must be
    fast; it may keep state across calls (a rotation), but only ids and numbers, never the views.
    ``uses_prefix_index`` (optional, default False): fill in :attr:`WorkerView.num_cached_tokens`.
    """

    kind: ClassVar[str]

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> int: ...


class LeastLoaded:
    """Fewest requests (:attr:`WorkerView.num_load`), then least KV in use; exact ties rotate, so idle
    workers share a burst instead of the first one taking it all."""

    kind: ClassVar[str] = "routing"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        self._next_tie = 0
        self.scores: dict[str, float] = {}  # the last decision's: −(requests + KV fraction), for traces

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> int:
        self.scores = {w.worker_id: -round(w.num_load + w.kv_usage, 4) for w in candidates}
        best: list[int] = []
        best_key: tuple[int, float] | None = None
        for index, worker in enumerate(candidates):
            key = (worker.num_load, worker.kv_usage)
            if best_key is None or key < best_key:
                best, best_key = [index], key
            elif key == best_key:
                best.append(index)
        chosen = best[self._next_tie % len(best)]
        self._next_tie += 1
        return chosen


class RoundRobin:
    """Each model's workers in turn, by worker id, whatever their load: the next id after the last one
    chosen for that model (wrapping). A worker that leaves or joins shifts nobody else's turn."""

    kind: ClassVar[str] = "routing"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        self._last: dict[str, str] = {}  # model → the worker id chosen last

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> int:
        order = sorted(range(len(candidates)), key=lambda i: candidates[i].worker_id)
        last = self._last.get(request.model)
        chosen = order[0]
        if last is not None:
            chosen = next((i for i in order if candidates[i].worker_id > last), order[0])
        self._last[request.model] = candidates[chosen].worker_id
        return chosen
