"""The gateway's long-lived parts, built once by ``serve`` and shared by every request handler.

It loads the gateway's policies from the config: admission (gateway/admission.py asks it), routing
(handed to the dispatcher's worker registry) and degradation (:meth:`Gateway.place`, asked once per
request before anything is tokenized or dispatched).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway import errors
from gateway.admission import AdmissionBook
from gateway.dispatch import Dispatcher
from gateway.drain import Drain
from gateway.errors import APIError
from gateway.feasibility import FeasibilityLog
from gateway.instruments import GatewayMetrics
from gateway.logprobs import TokenTexts
from gateway.structured import StructuredCheck
from gateway.tokenizer import PromptBuilder
from gateway.workers import WorkerInfo, WorkerState, takes
from policies.degradation import DegradationPolicy, DegradationView, predict_ttft_s
from policies.registry import load_policy
from telemetry import Telemetry
from wire.config import ServerConfig
from wire.tier import Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one request runs: ``model`` is the served model (the fallback's name when degraded)."""

    model: str
    requested: str  # what the client put in "model"
    is_degraded: bool = False


@dataclass(slots=True)
class Gateway:
    dispatcher: Dispatcher
    config: ServerConfig
    builders: Mapping[str, PromptBuilder]  # served model name → its prompt builder
    started_at: int
    fallbacks: Mapping[str, str] = field(default_factory=dict)  # primary model → its fallback pool's model
    drain: Drain = field(default_factory=Drain)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    telemetry: Telemetry = field(default_factory=Telemetry.off)  # traces: a no-op tracer unless configured
    check_structured: StructuredCheck = field(default_factory=StructuredCheck)  # grammars, at the door
    admissions: AdmissionBook = field(init=False)
    degradation: DegradationPolicy = field(init=False)
    _token_texts: dict[str, TokenTexts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        policies = self.config.policies
        allow = policies.allow_plugins
        admission = load_policy(
            "admission", policies.admission.name, policies.admission.params, allow_plugins=allow
        )
        self.admissions = AdmissionBook(self.config.tiers, self.capacity_of, admission)
        self.dispatcher.registry.routing = load_policy(
            "routing", policies.routing.name, policies.routing.params, allow_plugins=allow
        )
        self.degradation = load_policy(
            "degradation", policies.degradation.name, policies.degradation.params, allow_plugins=allow
        )
        self.dispatcher.add_listener(self.admissions.capacity_changed)
        self.dispatcher.add_listener(FeasibilityLog(self.config.tiers, self.dispatcher.registry))
        self.metrics.watch(self.dispatcher, self.admissions)
        self.metrics.export(self.telemetry)  # over OTLP too, when OTEL_* configures metrics export

    def builder(self, model: str) -> PromptBuilder:
        builder = self.builders.get(model)
        if builder is None:
            raise errors.unknown_model(model, list(self.builders))
        return builder

    def token_texts(self, model: str) -> TokenTexts:
        texts = self._token_texts.get(model)
        if texts is None:
            texts = self._token_texts[model] = TokenTexts(self.builder(model).token_bytes)
        return texts

    def longest_context(self, model: str) -> int:
        """The longest context of ``model``'s registered workers (503 while none has registered)."""
        known = [w.register.max_model_len for w in self.dispatcher.registry if w.model == model]
        if not known:
            why = f"no worker of model {model!r} has registered yet"
            raise APIError(503, why, code="no_worker_available")
        return max(known)

    def ready_workers(self, model: str) -> list[int]:
        """``max_num_seqs`` of each ready worker of ``model``."""
        return [
            w.register.max_num_seqs
            for w in self.dispatcher.registry
            if w.model == model and w.state is WorkerState.READY
        ]

    def capacity_of(self, model: str) -> int:
        """Seats admission may fill for ``model``: the ready workers' sequences, oversubscribed a little."""
        factor = self.config.gateway.max_in_flight_factor
        return sum(max(1, round(seqs * factor)) for seqs in self.ready_workers(model))

    def context_of(self, model: str, num_prompt_tokens: int, param: str = "prompt") -> tuple[int, int | None]:
        """(max_model_len, vocab_size) over the ready workers of ``model`` that take a prompt this long:
        those serving its context class (gateway.context_classes) with room after it; the smallest of
        each, so a request that fits fits on whichever of them is picked.

        None of them: 503 when some worker that would take it is only not ready (or none is ready at
        all); 400 ``context_length_exceeded`` when no worker of the model takes such a prompt, before
        any work is done."""
        registry = self.dispatcher.registry
        band = self.config.gateway.context_class(num_prompt_tokens)
        ready = [w.register for w in self._taking(model, num_prompt_tokens)]
        if ready:
            vocab_sizes = [r.vocab_size for r in ready if r.vocab_size is not None]
            return min(r.max_model_len for r in ready), min(vocab_sizes) if vocab_sizes else None
        known = [w for w in registry if w.model == model]
        if not registry.ready(model) or any(takes(w, band, num_prompt_tokens) for w in known):
            raise APIError(
                503, f"no ready worker serves model {model!r} for {band} prompts", code="no_worker_available"
            )
        served = [w.register.max_model_len for w in known if takes(w, band)]
        why = (
            f"{num_prompt_tokens} tokens leave no room in the model's context of {max(served)} tokens"
            if served
            else f"{num_prompt_tokens} tokens: no pool of model {model!r} takes {band} prompts"
        )
        raise APIError(400, f"{param}: {why}", param=param, code="context_length_exceeded")

    def fits(self, model: str, num_prompt_tokens: int) -> bool:
        """Whether a prompt this long has a ready worker of ``model`` to run on, with room for output."""
        return bool(self._taking(model, num_prompt_tokens))

    def _taking(self, model: str, num_prompt_tokens: int) -> list[WorkerInfo]:
        """The ready workers of ``model`` that take a prompt this long (its class, and room after it)."""
        band = self.config.gateway.context_class(num_prompt_tokens)
        return self.dispatcher.registry.ready(model, context_class=band, num_prompt_tokens=num_prompt_tokens)

    # ---- degradation ---------------------------------------------------------------------------

    def place(self, model: str, tier: Tier, seats: int) -> Placement:
        """Primary or fallback for one request of ``model`` at ``tier`` asking for ``seats``: the
        degradation policy's choice, made once. A model without a fallback pool (a fallback itself, when
        asked for by name) is served as asked. A "fallback" the policy may not give (the tier is not
        degradable, or no fallback worker is ready) is logged and ignored."""
        fallback = self.fallbacks.get(model)
        if fallback is None:
            return Placement(model, model)
        view = self.degradation_view(model, fallback, tier, seats)
        choice = self.degradation.decide(view)
        if choice == "fallback" and tier.degradable and view.fallback_ready:
            return Placement(fallback, model, is_degraded=True)
        if choice not in ("primary", "fallback"):
            log.error(
                "degradation policy %s answered %r; serving on the primary",
                type(self.degradation).__name__,
                choice,
            )
        elif choice == "fallback":
            log.error(
                "degradation policy %s degraded a request it may not (tier %r, fallback ready: %s); "
                "serving on the primary",
                type(self.degradation).__name__,
                tier.name,
                view.fallback_ready,
            )
        return Placement(model, model)

    def degradation_view(self, primary: str, fallback: str, tier: Tier, seats: int) -> DegradationView:
        primary_ttft, primary_ready = self._prediction(primary, tier, seats)
        fallback_ttft, fallback_ready = self._prediction(fallback, tier, seats)
        return DegradationView(
            tier=tier,
            primary=primary,
            fallback=fallback,
            seats=seats,
            predicted_ttft_s=primary_ttft,
            primary_circuit_open=not primary_ready,
            fallback_ready=fallback_ready,
            fallback_predicted_ttft_s=fallback_ttft,
        )

    def _prediction(self, model: str, tier: Tier, seats: int) -> tuple[float | None, bool]:
        """(predicted TTFT of a request on ``model``'s pool, whether it has a ready worker)."""
        registry = self.dispatcher.registry
        workers = [registry.view(info) for info in registry.ready(model)]
        if not workers:
            return None, False
        wait = self.admissions(model).view(tier, seats).expected_wait_s()
        return predict_ttft_s(wait, workers), True
