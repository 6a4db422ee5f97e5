"""What the gateway measures, by name: the instruments ``/metrics`` renders (see gateway/metrics.py).

Per request (recorded by gateway/completion.py as it happens), labelled by model and tier:
    tierserve_requests_total{status}            every completion request, by final HTTP status
    tierserve_shed_total                        429s from admission
    tierserve_degraded_total                    requests sent to the fallback pool (model: the one asked for)
    tierserve_prompt_tokens_total, _output_tokens_total, _cached_tokens_total
    tierserve_time_to_first_token_seconds       arrival at the gateway → first token sent
    tierserve_time_per_output_token_seconds     (last − first token) / (tokens − 1), per request
    tierserve_e2e_request_latency_seconds       arrival → last byte
    tierserve_queue_time_seconds                time waiting in the gateway's admission queue
Read at scrape (from admission, the dispatcher and the workers' last heartbeats):
    tierserve_admission_queue_length{model,tier}, tierserve_admission_seats_in_use{model}
    tierserve_worker_up{worker,model,state}, tierserve_worker_requests_running / _waiting,
    tierserve_worker_kv_blocks_free / _total, tierserve_worker_step_time_seconds,
    tierserve_worker_preemptions_total, tierserve_wire_frames_dropped_total{reason},
    tierserve_workers_lost_total, tierserve_migrations_total{model}
"""

from __future__ import annotations

from gateway.admission import AdmissionBook
from gateway.dispatch import Dispatcher
from gateway.metrics import TOKEN_LATENCY_BUCKETS, Registry
from gateway.workers import WorkerState


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = Registry()
        mt = ("model", "tier")
        self.requests = r.counter("tierserve_requests_total", "Completion requests by final status.",
                                  ("model", "tier", "status"))  # fmt: skip
        self.shed = r.counter("tierserve_shed_total", "Requests refused with 429 by admission.", mt)
        self.degraded = r.counter(
            "tierserve_degraded_total", "Requests served by the fallback pool, by the model asked for.", mt
        )
        self.prompt_tokens = r.counter(
            "tierserve_prompt_tokens_total", "Prompt tokens, finished requests.", mt
        )
        self.output_tokens = r.counter("tierserve_output_tokens_total", "Tokens generated.", mt)
        self.cached_tokens = r.counter(
            "tierserve_cached_tokens_total", "Prompt tokens served from the prefix cache.", mt
        )
        self.ttft = r.histogram(
            "tierserve_time_to_first_token_seconds", "Arrival at the gateway to the first token sent.", mt
        )
        self.tpot = r.histogram(
            "tierserve_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1).",
            mt,
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = r.histogram("tierserve_e2e_request_latency_seconds", "Arrival to the last byte.", mt)
        self.queue_time = r.histogram(
            "tierserve_queue_time_seconds", "Time waiting in the gateway's admission queue.", mt
        )
        self.queue_length = r.gauge(
            "tierserve_admission_queue_length", "Requests waiting at the gateway.", ("model", "tier")
        )
        self.seats_in_use = r.gauge(
            "tierserve_admission_seats_in_use", "Sequences admitted and not finished.", ("model",)
        )
        w = ("worker", "model")
        self.worker_up = r.gauge(
            "tierserve_worker_up", "1 for the worker's current state.", ("worker", "model", "state")
        )
        self.worker_running = r.gauge("tierserve_worker_requests_running", "Requests running.", w)
        self.worker_waiting = r.gauge("tierserve_worker_requests_waiting", "Requests waiting.", w)
        self.worker_free_blocks = r.gauge("tierserve_worker_kv_blocks_free", "Free KV cache blocks.", w)
        self.worker_total_blocks = r.gauge("tierserve_worker_kv_blocks_total", "KV cache blocks.", w)
        self.worker_step_time = r.gauge(
            "tierserve_worker_step_time_seconds", "Moving average of the engine step time.", w
        )
        self.worker_preemptions = r.counter("tierserve_worker_preemptions_total", "Preemptions.", w)
        self.frames_dropped = r.counter(
            "tierserve_wire_frames_dropped_total", "Frames from workers dropped at the gateway.", ("reason",)
        )
        self.workers_lost = r.counter("tierserve_workers_lost_total", "Workers declared lost.")
        self.migrations = r.counter(
            "tierserve_migrations_total", "Requests moved to another worker after losing theirs.", ("model",)
        )

    def watch(self, dispatcher: Dispatcher, admissions: AdmissionBook) -> None:
        """Refresh the scrape-time figures from ``dispatcher`` and ``admissions`` on every render."""

        def collect() -> None:
            self.queue_length.clear()
            self.seats_in_use.clear()
            for model, admission in admissions.by_model.items():
                self.seats_in_use.set(model, value=admission.seats_in_use)
                for tier in admissions.tiers:
                    self.queue_length.set(model, tier.name, value=admission.queue_length(tier.name))
            for gauge in (self.worker_up, self.worker_running, self.worker_waiting, self.worker_free_blocks,
                          self.worker_total_blocks, self.worker_step_time):  # fmt: skip
                gauge.clear()
            for worker in dispatcher.registry:
                for state in WorkerState:
                    self.worker_up.set(
                        worker.worker_id, worker.model, state.value, value=float(worker.state is state)
                    )
                stats = worker.stats
                if stats is None or worker.state is WorkerState.DEAD:
                    continue
                key = (worker.worker_id, worker.model)
                self.worker_running.set(*key, value=stats.num_running)
                self.worker_waiting.set(*key, value=stats.num_waiting)
                self.worker_free_blocks.set(*key, value=stats.num_free_blocks)
                self.worker_total_blocks.set(*key, value=stats.num_total_blocks)
                self.worker_step_time.set(*key, value=stats.step_time_ema_ms / 1e3)
                self.worker_preemptions.set_total(*key, total=stats.num_preemptions)
            stats_now = dispatcher.stats()
            decode = stats_now.decode
            for reason, total in (
                ("oversize", decode.dropped_oversize),
                ("malformed", decode.dropped_malformed),
                ("version", decode.dropped_version),
                ("multipart", stats_now.num_dropped_multipart),
                ("unknown_peer", stats_now.num_dropped_unknown_peer),
                ("stale", stats_now.num_stale_deltas),
            ):
                self.frames_dropped.set_total(reason, total=total)
            self.workers_lost.set_total(total=stats_now.num_workers_lost)
            for model, total in stats_now.num_migrations.items():
                self.migrations.set_total(model, total=total)

        self.registry.on_collect(collect)
