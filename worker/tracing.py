"""The worker's part of a request's trace, recorded from what the engine already knows each step.

    Submit (W3C context of the gateway's dispatch span)
      └─ tierserve.worker.request        Submit → finish (or abort)
           ├─ tierserve.worker.queue     Submit → first scheduled
           ├─ tierserve.worker.prefill   one per prefill chunk (recompute after a preemption too)
           ├─ tierserve.worker.decode    first token → finish; events: preempted, resumed, every 64 tokens
           └─ tierserve.worker.finish    reason and counts

The engine calls its observer twice a step (:meth:`on_schedule` before the model runs, :meth:`on_step_done`
after sampling) and on every abort. With tracing off the observer is :class:`NullObserver`, whose methods
do nothing; with tracing on but no traced request running, each call is one empty-dict check. Spans are
created after the fact with explicit timestamps, so nothing is kept open per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from telemetry import attributes as attr
from telemetry import extract
from wire.messages import Submit
from worker.outputs import RequestOutput
from worker.scheduler import SchedulerOutput


class NullObserver:
    """Tracing off: every hook is a no-op (the engine never asks whether tracing is on)."""

    def begin(self, submit: Submit, num_prompt_tokens: int) -> None:
        pass

    def on_schedule(self, out: SchedulerOutput) -> None:
        pass

    def on_step_done(self, out: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        pass

    def on_abort(self, request_id: str) -> None:
        pass


NULL_OBSERVER = NullObserver()


@dataclass(slots=True)
class _Traced:
    span: trace.Span  # tierserve.worker.request
    context: Context  # ``span`` as the parent of the others
    submitted_ns: int
    is_scheduled: bool = False
    is_preempted: bool = False
    chunk: tuple[int, int, int] | None = None  # (start ns, tokens, tokens computed before) of this step
    decode: trace.Span | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0


class RequestTracer(NullObserver):
    """Spans for the requests whose Submit carried a sampled trace context; the rest cost a dict miss."""

    def __init__(self, tracer: trace.Tracer, worker_id: str) -> None:
        self._tracer = tracer
        self._worker_id = worker_id
        self._live: dict[str, _Traced] = {}

    def begin(self, submit: Submit, num_prompt_tokens: int) -> None:
        parent = extract(submit.trace_context)
        if parent is None:
            return  # not traced by the gateway: no root spans of our own
        now = time.time_ns()
        span = self._tracer.start_span(
            attr.WORKER_REQUEST,
            context=parent,
            kind=SpanKind.CONSUMER,
            start_time=now,
            attributes={
                attr.WORKER: self._worker_id,
                attr.REQUEST_ID: submit.request_id,
                attr.TIER: submit.tier.name,
                attr.TENANT: submit.tenant or "",
                attr.PROMPT_TOKENS: num_prompt_tokens,
                "tierserve.epoch": submit.epoch,
                "tierserve.resumed_tokens": len(submit.resumed_token_ids),
            },
        )
        if not span.is_recording():
            return  # sampled out upstream
        self._end(submit.request_id, "superseded", now)  # an older epoch of the same request, if any
        self._live[submit.request_id] = _Traced(span, trace.set_span_in_context(span), now)

    def on_schedule(self, out: SchedulerOutput) -> None:
        if not self._live:
            return
        now = time.time_ns()
        for request in out.preempted:
            traced = self._live.get(request.request_id)
            if traced is not None:
                traced.is_preempted = True
                traced.num_preemptions += 1
                on = traced.decode or traced.span
                on.add_event(attr.EVENT_PREEMPTED, {attr.OUTPUT_TOKENS: request.num_output_tokens}, now)
        for request in out.scheduled:
            traced = self._live.get(request.request_id)
            if traced is None:
                continue
            if not traced.is_scheduled:
                traced.is_scheduled = True
                queue = self._tracer.start_span(
                    attr.WORKER_QUEUE, traced.context, start_time=traced.submitted_ns
                )
                queue.end(end_time=now)
            if traced.is_preempted:
                traced.is_preempted = False
                on = traced.decode or traced.span
                on.add_event(attr.EVENT_RESUMED, {attr.OUTPUT_TOKENS: request.num_output_tokens}, now)
            # Counters are still those before the step: a chunk that is not just the last token (or the
            # first step of any request) is prefill, including a recompute after preemption.
            is_prefill = (
                request.num_computed_tokens < request.num_tokens - 1 or request.num_output_tokens == 0
            )
            if is_prefill:
                num_new = out.num_scheduled_tokens[request.request_id]
                traced.chunk = (now, num_new, request.num_computed_tokens)

    def on_step_done(self, out: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        if not self._live:
            return
        now = time.time_ns()
        for request in out.scheduled:
            traced = self._live.get(request.request_id)
            if traced is not None and traced.chunk is not None:
                start_ns, num_new, num_before = traced.chunk
                traced.chunk = None
                chunk = self._tracer.start_span(
                    attr.WORKER_PREFILL,
                    traced.context,
                    start_time=start_ns,
                    attributes={
                        attr.CHUNK_TOKENS: num_new,
                        attr.CHUNK_START: num_before,
                        attr.CACHED_TOKENS: request.num_cached_tokens,
                    },
                )
                chunk.end(end_time=now)
        for output in outputs:
            traced = self._live.get(output.request_id)
            if traced is None:
                continue
            if output.new_token_ids:
                if traced.decode is None:
                    traced.decode = self._tracer.start_span(
                        attr.WORKER_DECODE, traced.context, start_time=now
                    )
                before = traced.num_output_tokens
                traced.num_output_tokens += len(output.new_token_ids)
                interval = attr.TOKENS_EVENT_INTERVAL
                if traced.num_output_tokens // interval > before // interval:
                    traced.decode.add_event(
                        attr.EVENT_TOKENS, {attr.OUTPUT_TOKENS: traced.num_output_tokens}, now
                    )
            if output.finish_reason is not None:
                self._end(output.request_id, output.finish_reason.value, now, output)

    def on_abort(self, request_id: str) -> None:
        if self._live:
            self._end(request_id, "abort", time.time_ns())

    def _end(self, request_id: str, reason: str, now: int, output: RequestOutput | None = None) -> None:
        traced = self._live.pop(request_id, None)
        if traced is None:
            return
        counts: dict[str, str | int] = {
            attr.FINISH_REASON: reason,
            attr.OUTPUT_TOKENS: traced.num_output_tokens,
            attr.PREEMPTIONS: traced.num_preemptions,
        }
        if output is not None:
            counts[attr.CACHED_TOKENS] = output.num_cached_tokens
        finish = self._tracer.start_span(
            attr.WORKER_FINISH, traced.context, start_time=now, attributes=counts
        )
        finish.end(end_time=now)
        if traced.decode is not None:
            traced.decode.set_attribute(attr.OUTPUT_TOKENS, traced.num_output_tokens)
            traced.decode.end(end_time=now)
        traced.span.set_attributes(counts)
        if reason == "error":
            traced.span.set_status(Status(StatusCode.ERROR, output.error if output is not None else None))
        traced.span.end(end_time=now)
