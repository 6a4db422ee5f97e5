"""What the gateway measures, by name: the instruments ``/metrics`` renders (see gateway/metrics.py), and
the same figures through an OpenTelemetry meter when ``OTEL_*`` configures metrics export (:data:`OTLP`).

Per request (recorded by gateway/completion.py as it happens), labelled by model and tier:
    tierserve_requests_total{status}            every completion request, by final HTTP status
    tierserve_shed_total                        429s from admission
    tierserve_degraded_total                    requests sent to the fallback pool (model: the one asked for)
    tierserve_prompt_tokens_total, _output_tokens_total, _cached_tokens_total
    tierserve_time_to_first_token_seconds       arrival at the gateway → first token sent
    tierserve_time_per_output_token_seconds     (last − first token) / (tokens − 1), per choice
    tierserve_inter_token_latency_seconds       the gap between one choice's successive token deliveries
    tierserve_e2e_request_latency_seconds       arrival → last byte
    tierserve_queue_time_seconds                time waiting in the gateway's admission queue
Read at scrape (from admission, the dispatcher and the workers' last heartbeats):
    tierserve_admission_queue_length{model,tier}, tierserve_admission_seats_in_use{model}
    tierserve_worker_up{worker,model,state}, tierserve_worker_requests_running / _waiting,
    tierserve_worker_kv_blocks_used / _free / _total, tierserve_worker_step_time_seconds,
    tierserve_worker_prefix_cache_hit_ratio, tierserve_worker_preemptions_total,
    tierserve_worker_kv_evictions_total, tierserve_worker_prefix_cache_queries_total / _hits_total,
    tierserve_prefix_index_blocks{worker,model}, tierserve_prefix_index_resyncs_total (routing's index)
    tierserve_wire_frames_dropped_total{reason}, tierserve_workers_lost_total,
    tierserve_migrations_total{model}
From each worker's Register:
    tierserve_quant_layer_error{worker,model,layer}   a quantized linear's output error, measured at load
    tierserve_tier_slo_feasible{model,tier}           1 if a worker's measured floor meets the tier's targets
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.admission import AdmissionBook
from gateway.dispatch import Dispatcher
from gateway.feasibility import feasible_by_tier
from gateway.metrics import TOKEN_LATENCY_BUCKETS, Counter, Gauge, Histogram, Labels, Registry
from gateway.workers import WorkerState
from telemetry import Telemetry
from telemetry import attributes as attr
from telemetry.metrics_bridge import Instrument, LoopReader, histogram_sink, publish_series

# Labels as OpenTelemetry attributes. ``model`` is the served model (the fallback pool's when degraded:
# what the response names), except on tierserve.degraded, where it is the model asked for.
MODEL, TIER, STATUS = attr.GEN_AI_RESPONSE_MODEL, attr.TIER, "http.response.status_code"
WORKER, STATE, REASON = attr.WORKER, "tierserve.worker.state", "tierserve.wire.reason"
MT, WM = (MODEL, TIER), (WORKER, MODEL)
C, U, G, H = "counter", "updowncounter", "gauge", "histogram"

# Prometheus name → the same figure over OTLP: the GenAI semantic conventions' gen_ai.server.* histograms
# where they exist, else tierserve.* names that the OTLP → Prometheus translation (unit suffix, _total on
# counters, _ratio for unit 1) turns back into the Prometheus name. docs/observability.md has the table.
OTLP: dict[str, Instrument] = {
    "tierserve_requests_total": Instrument("tierserve.requests", "{request}", C, (*MT, STATUS)),
    "tierserve_shed_total": Instrument("tierserve.shed", "{request}", C, MT),
    "tierserve_degraded_total": Instrument(
        "tierserve.degraded", "{request}", C, (attr.GEN_AI_REQUEST_MODEL, TIER)
    ),
    "tierserve_prompt_tokens_total": Instrument("tierserve.prompt_tokens", "{token}", C, MT),
    "tierserve_output_tokens_total": Instrument("tierserve.output_tokens", "{token}", C, MT),
    "tierserve_cached_tokens_total": Instrument("tierserve.cached_tokens", "{token}", C, MT),
    "tierserve_time_to_first_token_seconds": Instrument("gen_ai.server.time_to_first_token", "s", H, MT),
    "tierserve_time_per_output_token_seconds": Instrument("gen_ai.server.time_per_output_token", "s", H, MT),
    "tierserve_inter_token_latency_seconds": Instrument("tierserve.inter_token_latency", "s", H, MT),
    "tierserve_e2e_request_latency_seconds": Instrument("gen_ai.server.request.duration", "s", H, MT),
    "tierserve_queue_time_seconds": Instrument("tierserve.queue_time", "s", H, MT),
    "tierserve_admission_queue_length": Instrument("tierserve.admission.queue_length", "{request}", U, MT),
    "tierserve_admission_seats_in_use": Instrument(
        "tierserve.admission.seats_in_use", "{sequence}", U, (MODEL,)
    ),
    "tierserve_worker_up": Instrument("tierserve.worker.up", "{worker}", U, (*WM, STATE)),
    "tierserve_worker_requests_running": Instrument("tierserve.worker.requests_running", "{request}", U, WM),
    "tierserve_worker_requests_waiting": Instrument("tierserve.worker.requests_waiting", "{request}", U, WM),
    "tierserve_worker_kv_blocks_used": Instrument("tierserve.worker.kv_blocks_used", "{block}", U, WM),
    "tierserve_worker_kv_blocks_free": Instrument("tierserve.worker.kv_blocks_free", "{block}", U, WM),
    "tierserve_worker_kv_blocks_total": Instrument("tierserve.worker.kv_blocks_total", "{block}", U, WM),
    "tierserve_worker_step_time_seconds": Instrument("tierserve.worker.step_time", "s", G, WM),
    "tierserve_worker_prefix_cache_hit_ratio": Instrument(
        "tierserve.worker.prefix_cache_hit_ratio", "1", G, WM
    ),
    "tierserve_worker_preemptions_total": Instrument("tierserve.worker.preemptions", "{preemption}", C, WM),
    "tierserve_worker_kv_evictions_total": Instrument("tierserve.worker.kv_evictions", "{block}", C, WM),
    "tierserve_worker_prefix_cache_queries_total": Instrument(
        "tierserve.worker.prefix_cache_queries", "{token}", C, WM
    ),
    "tierserve_worker_prefix_cache_hits_total": Instrument(
        "tierserve.worker.prefix_cache_hits", "{token}", C, WM
    ),
    "tierserve_prefix_index_blocks": Instrument("tierserve.prefix_index.blocks", "{block}", U, WM),
    "tierserve_prefix_index_resyncs_total": Instrument("tierserve.prefix_index.resyncs", "{resync}", C, WM),
    "tierserve_wire_frames_dropped_total": Instrument(
        "tierserve.wire.frames_dropped", "{frame}", C, (REASON,)
    ),
    "tierserve_workers_lost_total": Instrument("tierserve.workers_lost", "{worker}", C),
    "tierserve_migrations_total": Instrument("tierserve.migrations", "{request}", C, (MODEL,)),
    "tierserve_quant_layer_error": Instrument(
        "tierserve.quant.layer_error", "{error}", G, (*WM, attr.QUANT_LAYER)
    ),
    "tierserve_tier_slo_feasible": Instrument("tierserve.tier.slo_feasible", "{tier}", G, (MODEL, TIER)),
}


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = Registry()
        mt = ("model", "tier")
        self.requests = r.counter(
            "tierserve_requests_total", "Completion requests by final status.", ("model", "tier", "status")
        )
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
            "Per choice: (last token - first token) / (tokens - 1).",
            mt,
            TOKEN_LATENCY_BUCKETS,
        )
        self.itl = r.histogram(
            "tierserve_inter_token_latency_seconds",
            "Gap between one choice's successive token deliveries.",
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
        self.worker_used_blocks = r.gauge("tierserve_worker_kv_blocks_used", "KV cache blocks in use.", w)
        self.worker_free_blocks = r.gauge("tierserve_worker_kv_blocks_free", "Free KV cache blocks.", w)
        self.worker_total_blocks = r.gauge("tierserve_worker_kv_blocks_total", "KV cache blocks.", w)
        self.worker_step_time = r.gauge(
            "tierserve_worker_step_time_seconds", "Moving average of the engine step time.", w
        )
        self.worker_hit_ratio = r.gauge(
            "tierserve_worker_prefix_cache_hit_ratio",
            "Prompt tokens found in the prefix cache / looked up.",
            w,
        )
        self.worker_preemptions = r.counter("tierserve_worker_preemptions_total", "Preemptions.", w)
        self.worker_evictions = r.counter(
            "tierserve_worker_kv_evictions_total", "Cached prefix blocks reused for other KV.", w
        )
        self.worker_prefix_queries = r.counter(
            "tierserve_worker_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", w
        )
        self.worker_prefix_hits = r.counter(
            "tierserve_worker_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", w
        )
        self.index_blocks = r.gauge(
            "tierserve_prefix_index_blocks",
            "Blocks the gateway's routing index holds for the worker (absent while it is being resynced).",
            w,
        )
        self.index_resyncs = r.counter(
            "tierserve_prefix_index_resyncs_total",
            "Snapshots of the worker's prefix cache asked for (a restart, a new link, a lost event).",
            w,
        )
        self.frames_dropped = r.counter(
            "tierserve_wire_frames_dropped_total", "Frames from workers dropped at the gateway.", ("reason",)
        )
        self.workers_lost = r.counter("tierserve_workers_lost_total", "Workers declared lost.")
        self.migrations = r.counter(
            "tierserve_migrations_total", "Requests moved to another worker after losing theirs.", ("model",)
        )
        self.quant_layer_error = r.gauge(
            "tierserve_quant_layer_error",
            "A quantized linear's output error against its exact weight (relative L2), measured at load.",
            ("worker", "model", "layer"),
        )
        self.tier_feasible = r.gauge(
            "tierserve_tier_slo_feasible",
            "1 when some worker of the model, alone, meets the tier's TTFT and TPOT targets (its floor "
            "measured at start), else 0.",
            ("model", "tier"),
        )

    def watch(self, dispatcher: Dispatcher, admissions: AdmissionBook) -> None:
        """Refresh the scrape-time figures from ``dispatcher`` and ``admissions`` on every render."""
        per_worker = (
            self.worker_running,
            self.worker_waiting,
            self.worker_used_blocks,
            self.worker_free_blocks,
            self.worker_total_blocks,
            self.worker_step_time,
            self.worker_hit_ratio,
            self.index_blocks,
            self.quant_layer_error,
        )

        def collect() -> None:
            self.queue_length.clear()
            self.seats_in_use.clear()
            for model, admission in admissions.by_model.items():
                self.seats_in_use.set(model, value=admission.seats_in_use)
                for tier in admissions.tiers:
                    self.queue_length.set(model, tier.name, value=admission.queue_length(tier.name))
            self.tier_feasible.clear()
            for (model, tier_name), is_feasible in feasible_by_tier(
                admissions.tiers, dispatcher.registry
            ).items():
                self.tier_feasible.set(model, tier_name, value=float(is_feasible))
            self.worker_up.clear()
            for gauge in per_worker:
                gauge.clear()
            stats_now = dispatcher.stats()
            for worker in dispatcher.registry:
                for tier in admissions.tiers:  # rare events: a series at 0 from the start, for rate()
                    self.shed.ensure(worker.model, tier.name)
                    self.degraded.ensure(worker.model, tier.name)
                self.migrations.ensure(worker.model)
                for state in WorkerState:
                    self.worker_up.set(
                        worker.worker_id, worker.model, state.value, value=float(worker.state is state)
                    )
                key = (worker.worker_id, worker.model)
                self.index_resyncs.set_total(*key, total=worker.prefix.num_resyncs)
                if worker.state is not WorkerState.DEAD:
                    for layer, error in worker.register.quant_layer_errors.items():
                        self.quant_layer_error.set(*key, layer, value=error)
                stats = worker.stats
                if stats is None or worker.state is WorkerState.DEAD:
                    continue
                if worker.prefix.is_fresh:
                    self.index_blocks.set(*key, value=len(worker.prefix.hashes))
                self.worker_running.set(*key, value=stats.num_running)
                self.worker_waiting.set(*key, value=stats.num_waiting)
                self.worker_used_blocks.set(*key, value=stats.num_total_blocks - stats.num_free_blocks)
                self.worker_free_blocks.set(*key, value=stats.num_free_blocks)
                self.worker_total_blocks.set(*key, value=stats.num_total_blocks)
                self.worker_step_time.set(*key, value=stats.step_time_ema_ms / 1e3)
                if stats.num_prefix_query_tokens:  # nothing looked up yet: no ratio rather than 0
                    ratio = stats.num_prefix_hit_tokens / stats.num_prefix_query_tokens
                    self.worker_hit_ratio.set(*key, value=ratio)
                self.worker_preemptions.set_total(*key, total=stats.num_preemptions)
                self.worker_evictions.set_total(*key, total=stats.num_evictions)
                self.worker_prefix_queries.set_total(*key, total=stats.num_prefix_query_tokens)
                self.worker_prefix_hits.set_total(*key, total=stats.num_prefix_hit_tokens)
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

    def export(self, telemetry: Telemetry) -> None:
        """Publish every metric through ``telemetry``'s meter when metrics export is configured (else
        nothing at all). Call it on the event loop that records them: the exporter's thread reads the
        registry through that loop. Histograms get an OpenTelemetry twin with the same bucket bounds,
        fed by each observation; counters and gauges are observed, at export, from the registry."""
        if telemetry.meter_provider is None:
            return
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None  # built outside a loop (tests): read directly
        reader, meter = LoopReader(loop), telemetry.meter
        for metric in self.registry:
            instrument = OTLP[metric.name]
            if instrument.kind != metric.kind and (metric.kind, instrument.kind) != (G, U):
                raise ValueError(f"{metric.name} is a {metric.kind}; OTLP[...] says {instrument.kind}")
            if isinstance(metric, Histogram):
                metric.add_sink(histogram_sink(meter, instrument, metric.help, metric.buckets))
            elif isinstance(metric, Counter | Gauge):
                publish_series(meter, instrument, metric.help, self._reading(metric), reader)

    def _reading(self, metric: Counter | Gauge) -> Callable[[], dict[Labels, float]]:
        def read() -> dict[Labels, float]:
            self.registry.collect()  # the scrape-time figures, as /metrics would show them now
            return metric.values()

        return read
