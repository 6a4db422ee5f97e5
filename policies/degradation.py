"""Degradation at the gateway: serve a request on its model's primary pool, or on the fallback pool
(a smaller 16-bit model) when the primary would break the request's SLO or is down.

The gateway decides once per request, before anything is tokenized or dispatched, so a response (and
every chunk of a stream) comes from one model; it marks a degraded answer (the ``model`` field names the
fallback, ``x-degraded: true``) and counts it. A policy only chooses, from a :class:`DegradationView`.

The TTFT predictor (:func:`predict_ttft_s`), the same for every policy:

    predicted TTFT = admission wait + worker queue

    admission wait = the primary's admission expected wait for this request (``AdmissionView
                     .expected_wait_s``: the seats ahead of it past the fleet's capacity, over the drain
                     rate measured in the last 10 s); 0 when it would be admitted at once; unknown when
                     it would queue and nothing has finished lately
    worker queue   = min over the pool's ready workers of (num_queued + 1) × step_time_ema: the requests
                     ahead of it waiting for a running slot, plus its own prefill step, at the worker's
                     recent step time (0 before the worker reported a step)

It ignores prompt length and the steps that finishing requests free up, so it is coarse; that is why
``degrade-on-slo`` compares it against a fraction (``safety``) of the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Protocol, runtime_checkable

import msgspec

from policies.base import NoParams
from policies.routing import WorkerView
from wire.tier import Tier

Pool = Literal["primary", "fallback"]


def worker_queue_s(workers: Sequence[WorkerView]) -> float | None:
    """The worker part of the predictor: the shortest (queued + 1) × step time; None for no worker."""
    if not workers:
        return None
    return min((w.num_queued + 1) * (w.step_time_ema_ms or 0.0) / 1e3 for w in workers)


def predict_ttft_s(admission_wait_s: float | None, workers: Sequence[WorkerView]) -> float | None:
    """Admission wait + worker queue (see the module docstring); None when either is unknown."""
    queue_s = worker_queue_s(workers)
    if admission_wait_s is None or queue_s is None:
        return None
    return admission_wait_s + queue_s


@dataclass(frozen=True, slots=True)
class DegradationView:
    """One request (its tier and seats) and the state of its primary pool and of the fallback."""

    tier: Tier  # degradable? its TTFT target?
    primary: str  # the model the client asked for
    fallback: str | None  # the fallback pool's model; None when no fallback pool is configured
    seats: int  # sequences it asks for (its choices)
    predicted_ttft_s: float | None  # on the primary; None when unknown (see predict_ttft_s)
    primary_circuit_open: bool  # no ready primary worker: the primary cannot serve it now
    fallback_ready: bool  # a fallback pool exists and has a ready worker
    fallback_predicted_ttft_s: float | None = None  # the same prediction on the fallback

    @property
    def ttft_target_s(self) -> float | None:
        return None if self.tier.ttft_ms is None else self.tier.ttft_ms / 1e3


@runtime_checkable
class DegradationPolicy(Protocol):
    """Primary or fallback for one request.

    Invariants: "fallback" only when ``view.tier.degradable`` and ``view.fallback_ready`` (a tier that
    is not degradable is always served by the model it asked for; the gateway enforces this too, and
    logs a policy that breaks it). Called once per request on the event loop: it must be fast and must
    not block.
    """

    kind: ClassVar[str]

    def decide(self, view: DegradationView) -> Pool: ...


class Never:
    """Always the primary (the baseline): an overloaded primary queues or sheds, a down one is a 503."""

    kind: ClassVar[str] = "degradation"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        pass

    def decide(self, view: DegradationView) -> Pool:
        return "primary"


class DegradeOnSloParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Degrade when the predicted TTFT passes this fraction of the tier's target (the predictor is
    # coarse: leave it headroom).
    safety: Annotated[float, msgspec.Meta(gt=0)] = 0.8
    # A request that would queue at the primary while nothing has finished lately has no prediction;
    # count it as late (degrade) or not.
    unknown_is_late: bool = True
    # Degrade for the SLO only when the fallback is predicted to answer sooner than the primary.
    require_faster_fallback: bool = True


class DegradeOnSlo:
    """A degradable tier goes to a ready fallback when the primary's circuit is open, or when its
    predicted TTFT on the primary is past ``safety`` × the tier's TTFT target (unknown counts as late
    with ``unknown_is_late``) and the fallback is predicted to be faster. Tiers without a TTFT target
    degrade only when the primary is down."""

    kind: ClassVar[str] = "degradation"
    Params = DegradeOnSloParams

    def __init__(self, params: DegradeOnSloParams) -> None:
        self.params = params

    def decide(self, view: DegradationView) -> Pool:
        if not (view.tier.degradable and view.fallback_ready):
            return "primary"
        if view.primary_circuit_open:
            return "fallback"
        target = view.ttft_target_s
        if target is None:
            return "primary"
        predicted = view.predicted_ttft_s
        late = self.params.unknown_is_late if predicted is None else predicted > self.params.safety * target
        if not late:
            return "primary"
        if self.params.require_faster_fallback:
            other = view.fallback_predicted_ttft_s
            if other is None or (predicted is not None and other >= predicted):
                return "primary"
        return "fallback"
