"""The gateway's long-lived parts, built once by ``serve`` and shared by every request handler."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway import errors
from gateway.admission import AdmissionBook
from gateway.dispatch import Dispatcher
from gateway.drain import Drain
from gateway.errors import APIError
from gateway.instruments import GatewayMetrics
from gateway.logprobs import TokenTexts
from gateway.tokenizer import PromptBuilder
from gateway.workers import WorkerState
from policies.registry import load_policy
from wire.config import ServerConfig


@dataclass(slots=True)
class Gateway:
    dispatcher: Dispatcher
    config: ServerConfig
    builders: Mapping[str, PromptBuilder]  # served model name → its prompt builder
    started_at: int
    drain: Drain = field(default_factory=Drain)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    admissions: AdmissionBook = field(init=False)
    _token_texts: dict[str, TokenTexts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        selection = self.config.policies.admission
        policy = load_policy(
            "admission", selection.name, selection.params, allow_plugins=self.config.policies.allow_plugins
        )
        self.admissions = AdmissionBook(self.config.tiers, self.capacity_of, policy)
        self.dispatcher.add_listener(self.admissions.capacity_changed)
        self.metrics.watch(self.dispatcher, self.admissions)

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

    def context_of(self, model: str) -> tuple[int, int | None]:
        """(max_model_len, vocab_size) over the ready workers of ``model``: the smallest, so a request
        that fits fits on whichever worker is picked."""
        ready = [
            w.register for w in self.dispatcher.registry if w.model == model and w.state is WorkerState.READY
        ]
        if not ready:
            raise APIError(503, f"no ready worker serves model {model!r}", code="no_worker_available")
        vocab_sizes = [r.vocab_size for r in ready if r.vocab_size is not None]
        return min(r.max_model_len for r in ready), min(vocab_sizes) if vocab_sizes else None
