"""One completion request, from a parsed body to its answer.

    Job (choices: prompt × n) ─▶ admission (seats = choices; 429 + Retry-After) ─▶ one Submit per choice
        ─▶ ChoiceStreams (fan-in by index) ─▶ first token of every choice (a worker's refusal is a 4xx)
        ─▶ SSE events  or  one JSON body ─▶ seats released, metrics recorded

A client that goes away at any point (queued, waiting for its first token, mid-answer, streamed or not)
cancels the work, which aborts every choice on its worker. ``gateway.request_timeout_s`` bounds the
whole request: past it the answer is a 504 (or, mid-stream, an error event). The fan-in and that timer
are gateway/choice_streams.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from starlette.responses import Response
from starlette.types import Receive

from gateway import errors
from gateway.admission import Shed, Ticket
from gateway.choice_streams import ChoiceStreams
from gateway.completion_spans import ChoiceProgress, response_attributes, route_attributes
from gateway.errors import APIError
from gateway.identity import Identity
from gateway.logprobs import merge_prompt_logprobs
from gateway.openai_api import ChoiceResult, Renderer, finish_reason
from gateway.openai_types import UsageInfo
from gateway.request_stream import DispatchError, RequestStream
from gateway.sse import ClientDisconnected, EventStreamResponse, until_disconnect
from gateway.state import Gateway
from telemetry import attributes as attr
from telemetry import inject
from wire.messages import TokenDelta, Usage
from wire.sampling import SamplingParams

log = logging.getLogger(__name__)

CLIENT_GONE = "499"  # nginx's status for "the client closed the connection": only ever a metric label


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int  # choices of one prompt share its prompt tokens (counted once in usage)
    prompt_ids: list[int]
    sampling: SamplingParams


@dataclass(slots=True)
class Job:
    model: str
    identity: Identity
    choices: list[Choice]
    renderer: Renderer
    stream: bool
    context_class: str  # from the longest prompt (gateway.context_classes)
    operation: str  # gen_ai.operation.name: "chat" or "text_completion" (gateway/endpoint.py)
    # unique on this gateway, its choices' Submits named after it; the answer's id (the renderer's)
    # may be the client's instead (X-Request-Id, vLLM's request_id)
    request_id: str
    requested_model: str | None = None  # what the client asked for, when ``model`` is its fallback
    is_degraded: bool = False  # served by the fallback pool (the degradation policy chose, once)
    priority: int = 0  # the body's ``priority``: order within the tier (lower first)
    continuous_usage: bool = False  # streamed: the usage so far on every chunk (vLLM's option)
    arrival: float = field(default_factory=time.monotonic)

    @property
    def headers(self) -> dict[str, str]:
        headers = {
            "x-request-id": self.renderer.request_id,  # the answer's id, for logs and traces alike
            "x-sla-tier": self.identity.tier.name,
            "x-tierserve-model": self.model,
            "x-context-class": self.context_class,
        }
        if self.is_degraded:
            headers["x-degraded"] = "true"
        return headers


async def respond(gateway: Gateway, job: Job, receive: Receive) -> Response:
    """Admit, run and answer ``job``; raises :class:`APIError` for an answer that is an error."""
    tier = job.identity.tier
    labels = (job.model, tier.name)
    if job.is_degraded:
        gateway.metrics.degraded.inc(job.requested_model or job.model, tier.name)
    server_span = trace.get_current_span()  # the HTTP server span (telemetry/http.py), or a no-op one
    if server_span.is_recording():
        server_span.set_attributes(_request_attributes(job))
    admission = gateway.admissions(job.model)
    tracer = gateway.telemetry.tracer
    with tracer.start_as_current_span(attr.ADMISSION, attributes={attr.SEATS: len(job.choices)}) as admitted:
        try:
            ticket = await until_disconnect(
                receive, admission.admit(tier, seats=len(job.choices), priority=job.priority)
            )
        except Shed as exc:
            gateway.metrics.shed.inc(*labels)
            gateway.metrics.requests.inc(*labels, "429")
            raise APIError(
                429,
                f"{exc.reason}; retry after {exc.retry_after_s} s",
                code="overloaded",
                headers={"retry-after": str(exc.retry_after_s)},
            ) from None
        except ClientDisconnected:
            gateway.metrics.requests.inc(*labels, CLIENT_GONE)
            raise
        admitted.set_attribute(attr.QUEUE_TIME, ticket.waited_s)
    gateway.metrics.queue_time.observe(*labels, value=ticket.waited_s)
    run = _Run(gateway, job, ticket, server_span)
    try:
        streams = await until_disconnect(receive, run.start())
        if job.stream:
            return EventStreamResponse(run.events(streams), run.headers(), on_close=run.closer(streams))
        body = await until_disconnect(receive, run.collect(streams))
    except BaseException as exc:
        run.finish(_status_of(exc))
        raise
    run.finish("200")
    return Response(
        msgspec.json.encode(body),
        media_type="application/json",
        headers=run.headers(),
    )


def _status_of(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        return str(exc.status)
    if isinstance(exc, ClientDisconnected | asyncio.CancelledError | GeneratorExit):
        return CLIENT_GONE
    return "500"


class _Run:
    """The admitted part of one job: its streams, what each choice has sent, and the bookkeeping."""

    def __init__(self, gateway: Gateway, job: Job, ticket: Ticket, span: trace.Span) -> None:
        self.gateway = gateway
        self.job = job
        self.ticket = ticket
        self.span = span  # the server span: the response's attributes go on it in ``finish``
        self.capture_content = gateway.telemetry.capture_content and span.is_recording()
        self.streams: list[RequestStream] = []  # every choice's, for the span: worker and epoch at the end
        self.progress = [ChoiceProgress() for _ in job.choices]
        self.deadline = asyncio.get_running_loop().time() + gateway.config.gateway.request_timeout_s
        self._finished = False

    def headers(self) -> dict[str, str]:
        """The job's headers, and ``x-tierserve-worker``: the worker(s) its choices were placed on."""
        return {**self.job.headers, "x-tierserve-worker": ",".join(s.worker_id for s in self.streams)}

    async def start(self) -> ChoiceStreams:
        """Submit every choice and wait for each one's first delta."""
        job = self.job
        many = len(job.choices) > 1
        streams: list[RequestStream] = []
        try:
            for choice in job.choices:
                request_id = f"{job.request_id}-{choice.index}" if many else job.request_id
                streams.append(await self._dispatch(choice, request_id))
        except BaseException as exc:
            for stream in streams:
                stream.abort()
            if isinstance(exc, DispatchError):
                raise errors.from_dispatch(exc) from None
            raise
        fan = ChoiceStreams(streams, self.deadline)
        try:
            await fan.first_of_each()
            for _, delta in fan.pending:
                _raise_if_failed(delta)
        except BaseException as exc:
            await fan.aclose()
            if isinstance(exc, DispatchError):
                raise _as_api_error(exc) from None
            raise
        return fan

    async def _dispatch(self, choice: Choice, request_id: str) -> RequestStream:
        """Submit one choice inside its dispatch span, whose W3C context travels in the Submit: the
        worker's spans are its children. The routing decision (made inside ``submit``, with the send)
        gets its own child span with the candidates and the scores the policy weighed."""
        job = self.job
        tracer = self.gateway.telemetry.tracer
        dispatched: dict[str, str | int] = {attr.REQUEST_ID: request_id, attr.CHOICE_INDEX: choice.index}
        with tracer.start_as_current_span(
            attr.DISPATCH, kind=SpanKind.PRODUCER, attributes=dispatched
        ) as span:
            trace_context = inject(span)
            with tracer.start_as_current_span(attr.ROUTE) as route:
                stream = await self.gateway.dispatcher.submit(
                    job.model,
                    request_id,
                    choice.prompt_ids,
                    choice.sampling,
                    job.identity.tier,
                    trace_context=trace_context,
                    tenant=job.identity.tenant.name,
                    cache_salt=job.identity.cache_salt,
                    priority=job.priority,
                    context_class=self.gateway.config.gateway.context_class(len(choice.prompt_ids)),
                    arrival_time=time.time() - (time.monotonic() - job.arrival),
                )
                if route.is_recording():
                    route.set_attributes(route_attributes(stream))
            span.set_attribute(attr.WORKER, stream.worker_id)
        self.streams.append(stream)
        return stream

    def _on_delta(self, index: int, delta: TokenDelta) -> None:
        _raise_if_failed(delta)
        progress = self.progress[index]
        progress.last = delta
        if delta.token_ids:
            now = time.monotonic()
            if progress.first_at is None:
                progress.first_at = now
            if progress.last_at is not None:  # this choice's previous tokens: one inter-token gap
                labels = (self.job.model, self.job.identity.tier.name)
                self.gateway.metrics.itl.observe(*labels, value=now - progress.last_at)
            progress.last_at = now
            progress.num_tokens += len(delta.token_ids)
        if delta.logprobs:
            progress.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs:
            merge_prompt_logprobs(progress.prompt_logprobs, delta.prompt_position, delta.prompt_logprobs)

    def _done(self) -> bool:
        return all(p.last is not None and p.last.finish_reason is not None for p in self.progress)

    def usage(self) -> UsageInfo:
        usages = [p.last.usage if p.last is not None else Usage(prompt_tokens=0, completion_tokens=0)
                  for p in self.progress]  # fmt: skip
        return UsageInfo.total(usages, [c.prompt_index for c in self.job.choices])

    async def collect(self, streams: ChoiceStreams) -> object:
        try:
            async for index, delta in streams:
                self._on_delta(index, delta)
                self.progress[index].text.append(delta.text)
                self.progress[index].token_ids.extend(delta.token_ids)
                if self._done():
                    break
        except DispatchError as exc:
            raise _as_api_error(exc) from None
        finally:
            await streams.aclose()
        results = [
            ChoiceResult(
                index=choice.index,
                text="".join(p.text),
                logprobs=p.logprobs,
                finish_reason=finish_reason(p.last),
                prompt_logprobs=p.prompt_logprobs,
                token_ids=p.token_ids,
                stop_reason=None if p.last is None else p.last.stop_reason,
            )
            for choice, p in zip(self.job.choices, self.progress, strict=True)
        ]
        return self.job.renderer.whole(results, self.usage())

    async def events(self, streams: ChoiceStreams) -> AsyncGenerator[bytes, None]:
        renderer = self.job.renderer
        status = CLIENT_GONE  # unless we get to the end
        try:
            for choice in self.job.choices:
                for payload in renderer.opening(choice.index):
                    yield renderer.frame(payload)
            try:
                async for index, delta in streams:
                    self._on_delta(index, delta)
                    if self.capture_content:
                        self.progress[index].text.append(delta.text)
                    usage = self.usage() if self.job.continuous_usage else None
                    for chunk in renderer.chunks(self.job.choices[index].index, delta, usage):
                        yield renderer.frame(chunk)
                    if self._done():
                        break
                for payload in renderer.closing(self.usage()):
                    yield renderer.frame(payload)
                status = "200"
            except (DispatchError, APIError) as exc:
                failure = _as_api_error(exc)
                status = str(failure.status)
                for payload in renderer.failure(failure.body(), failure.status):
                    yield renderer.frame(payload)
            if renderer.done:
                yield renderer.done
        finally:
            await streams.aclose()
            self.finish(status)

    def closer(self, streams: ChoiceStreams) -> Callable[[], Awaitable[None]]:
        """Cleanup for a stream response whose events never started (the generator's own never runs)."""

        async def close() -> None:
            await streams.aclose()
            self.finish(CLIENT_GONE)

        return close

    def finish(self, status: str) -> None:
        """Give the seats back and record the request (once, whichever path ends it)."""
        if self._finished:
            return
        self._finished = True
        self.ticket.release()
        metrics = self.gateway.metrics
        labels = (self.job.model, self.job.identity.tier.name)
        metrics.requests.inc(*labels, status)
        if self.span.is_recording():
            job = self.job
            self.span.set_attributes(
                response_attributes(
                    job.model,
                    job.renderer.request_id,
                    self.usage(),
                    self.progress,
                    self.streams,
                    job.arrival,
                    self.capture_content,
                )
            )
        if status != "200":
            return
        metrics.e2e.observe(*labels, value=time.monotonic() - self.job.arrival)
        first = min((p.first_at for p in self.progress if p.first_at is not None), default=None)
        if first is not None:
            metrics.ttft.observe(*labels, value=first - self.job.arrival)
        for p in self.progress:
            if p.first_at is not None and p.last_at is not None and p.num_tokens > 1:
                metrics.tpot.observe(*labels, value=(p.last_at - p.first_at) / (p.num_tokens - 1))
        usage = self.usage()
        metrics.prompt_tokens.inc(*labels, amount=usage.prompt_tokens)
        metrics.output_tokens.inc(*labels, amount=usage.completion_tokens)
        metrics.cached_tokens.inc(*labels, amount=usage.prompt_tokens_details.cached_tokens)


def _request_attributes(job: Job) -> dict[str, str | bool | int | float]:
    """The GenAI request attributes and ours, for the server span."""
    sampling = job.choices[0].sampling
    return {
        attr.GEN_AI_OPERATION_NAME: job.operation,
        attr.GEN_AI_PROVIDER_NAME: "tierserve",
        attr.GEN_AI_REQUEST_MODEL: job.requested_model or job.model,
        attr.GEN_AI_REQUEST_MAX_TOKENS: sampling.max_tokens,
        attr.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
        attr.GEN_AI_REQUEST_CHOICE_COUNT: len(job.choices),
        attr.TIER: job.identity.tier.name,
        attr.CONTEXT_CLASS: job.context_class,
        attr.TENANT: job.identity.tenant.name,
        attr.DEGRADED: job.is_degraded,
    }


def _as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, DispatchError):
        return errors.from_dispatch(exc)
    raise exc


def _raise_if_failed(delta: TokenDelta) -> None:
    if delta.finish_reason == "error":
        log.error("request %s failed on its worker: %s", delta.request_id, delta.error)
        raise APIError(500, f"the worker failed this request: {delta.error}", code="internal_error")
    if delta.finish_reason == "abort":
        raise APIError(503, "the worker stopped before finishing this request; retry", code="aborted")
