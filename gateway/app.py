"""The HTTP front: the OpenAI endpoints, ``/v1/models``, ``/health`` and ``/ready``.

    headers ─▶ identity (tenant, tier; 401/400/403) ─▶ body ─▶ openai_api (decode) ─▶ tokenizer (thread)
        ─▶ context check ─▶ Dispatcher.submit(tier) ─▶ RequestStream
                                                            │
            JSON (collected)  or  SSE chunks (EventStreamResponse) ◀─┘

While draining (SIGTERM, see gateway/drain.py) the completion routes answer 503 and ``/ready`` 503.

The first token (or the worker's refusal) is awaited before any response starts, so a request the
worker rejects still gets its 4xx status instead of a 200 stream that carries an error.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway import errors
from gateway.dispatch import Dispatcher
from gateway.drain import Drain, DrainMiddleware
from gateway.errors import APIError
from gateway.identity import Identity, identify
from gateway.openai_api import (
    ChatCompletionRequest,
    ChatRenderer,
    CompletionRenderer,
    CompletionRequest,
    ModelCard,
    ModelList,
    Renderer,
    decode_chat,
    decode_completion,
)
from gateway.request_stream import DispatchError, RequestStream
from gateway.tokenizer import PromptBuilder, TemplateError, chat_ids_async, text_ids_async
from gateway.workers import WorkerState
from wire.config import ServerConfig
from wire.errors import InvalidRequestError
from wire.messages import TokenDelta
from wire.sampling import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")

BODY_DRAIN_FACTOR = 16  # read (and discard) up to this many times the limit, so the client sees the 413
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
COMPLETION_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH})  # refused while draining; waited for


@dataclass(slots=True)
class Gateway:
    dispatcher: Dispatcher
    config: ServerConfig
    builders: Mapping[str, PromptBuilder]  # served model name → its prompt builder
    started_at: int
    drain: Drain = field(default_factory=Drain)

    def headers(self, model: str, identity: Identity) -> dict[str, str]:
        return {"x-sla-tier": identity.tier.name, "x-tierserve-model": model}

    def builder(self, model: str) -> PromptBuilder:
        builder = self.builders.get(model)
        if builder is None:
            raise errors.unknown_model(model, list(self.builders))
        return builder

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


def create_app(gateway: Gateway) -> Starlette:
    async def chat(request: Request) -> Response:
        identity = identify(gateway.config, request.headers)
        body = await _read_body(request, gateway.config.gateway.max_body_bytes)
        parsed = _parse(decode_chat, body)
        builder = gateway.builder(parsed.model)
        _check(lambda: parsed.check_n(gateway.config.gateway.max_n))
        messages = _check(lambda: [{"role": m.role, "content": m.text()} for m in parsed.messages])
        try:
            prompt_ids = await chat_ids_async(builder, messages)
        except TemplateError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from None
        renderer = ChatRenderer(f"chatcmpl-{uuid.uuid4().hex}", parsed.model, parsed.include_usage)
        return await _run(gateway, identity, parsed, prompt_ids, renderer)

    async def completions(request: Request) -> Response:
        identity = identify(gateway.config, request.headers)
        body = await _read_body(request, gateway.config.gateway.max_body_bytes)
        parsed = _parse(decode_completion, body)
        builder = gateway.builder(parsed.model)
        _check(lambda: parsed.check_n(gateway.config.gateway.max_n))
        prompt = parsed.prompt
        prompt_ids = await text_ids_async(builder, prompt) if isinstance(prompt, str) else list(prompt)
        renderer = CompletionRenderer(f"cmpl-{uuid.uuid4().hex}", parsed.model, parsed.include_usage)
        return await _run(gateway, identity, parsed, prompt_ids, renderer)

    async def models(request: Request) -> Response:
        cards = [ModelCard(id=name, created=gateway.started_at) for name in gateway.builders]
        return _json(ModelList(data=cards))

    async def health(request: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    async def ready(request: Request) -> Response:
        if gateway.drain.is_draining:
            return Response("draining\n", status_code=503, media_type="text/plain")
        num_ready = gateway.dispatcher.registry.num_in_state(WorkerState.READY)
        if num_ready == 0:
            return Response("no ready worker\n", status_code=503, media_type="text/plain")
        return Response(f"{num_ready} workers ready\n", media_type="text/plain")

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return APIError(exc.status_code, exc.detail or "error", code="http_error").response()

    async def on_bug(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, "internal server error", code="internal_error").response()

    return Starlette(
        routes=[
            Route(CHAT_PATH, chat, methods=["POST"]),
            Route(COMPLETIONS_PATH, completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
        ],
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_bug},
        middleware=[Middleware(DrainMiddleware, drain=gateway.drain, paths=COMPLETION_PATHS)],
    )


async def _run(
    gateway: Gateway,
    identity: Identity,
    parsed: ChatCompletionRequest | CompletionRequest,
    prompt_ids: Sequence[int],
    renderer: Renderer,
) -> Response:
    model = parsed.model
    sampling = _sampling(gateway, parsed, prompt_ids)
    log.debug("request %s: tenant %s, tier %s", renderer.request_id, identity.tenant.name, identity.tier.name)
    try:
        stream = await gateway.dispatcher.submit(
            model, renderer.request_id, prompt_ids, sampling, identity.tier
        )
    except DispatchError as exc:
        raise errors.from_dispatch(exc) from None
    try:
        first = await anext(stream)
    except DispatchError as exc:
        raise errors.from_dispatch(exc) from None
    headers = gateway.headers(model, identity)
    if parsed.stream:
        return EventStreamResponse(_events(stream, first, renderer), headers)
    async with stream:
        text: list[str] = []
        delta = first
        while True:
            _raise_if_failed(delta)
            text.append(delta.text)
            if delta.finish_reason is not None:
                break
            try:
                delta = await anext(stream)
            except DispatchError as exc:
                raise errors.from_dispatch(exc) from None
    return _json(renderer.whole("".join(text), delta), headers)


async def _events(
    stream: RequestStream, first: TokenDelta, renderer: Renderer
) -> AsyncGenerator[bytes, None]:
    async with stream:
        try:
            opening = renderer.opening()
            if opening is not None:
                yield event(opening)
            delta = first
            while True:
                _raise_if_failed(delta)
                if delta.text:
                    yield event(renderer.chunk(delta.text, None))
                if delta.finish_reason is not None:
                    yield event(renderer.chunk("", delta))
                    if renderer.include_usage:
                        yield event(renderer.usage_chunk(delta))
                    break
                delta = await anext(stream)
        except (DispatchError, APIError) as exc:
            failure = exc if isinstance(exc, APIError) else errors.from_dispatch(exc)
            yield event(failure.body())
        yield DONE


def _raise_if_failed(delta: TokenDelta) -> None:
    if delta.finish_reason == "error":
        log.error("request %s failed on its worker: %s", delta.request_id, delta.error)
        raise APIError(500, f"the worker failed this request: {delta.error}", code="internal_error")
    if delta.finish_reason == "abort":
        raise APIError(503, "the worker stopped before finishing this request; retry", code="aborted")


def _sampling(
    gateway: Gateway, parsed: ChatCompletionRequest | CompletionRequest, prompt_ids: Sequence[int]
) -> SamplingParams:
    max_model_len, vocab_size = gateway.context_of(parsed.model)
    num_prompt = len(prompt_ids)
    if num_prompt == 0:
        raise APIError(400, "prompt: must contain at least one token", param="prompt")
    if num_prompt >= max_model_len:
        raise APIError(
            400,
            f"prompt: {num_prompt} tokens leave no room in the model's context of {max_model_len} tokens",
            param="messages" if isinstance(parsed, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    sampling = _check(lambda: parsed.to_sampling(max_model_len - num_prompt))
    if isinstance(parsed.prompt if isinstance(parsed, CompletionRequest) else None, list):
        bad = [t for t in prompt_ids if vocab_size is not None and not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt: token ids outside the vocabulary: {bad[:5]}", param="prompt")
    _check(
        lambda: sampling.validate(
            vocab_size=vocab_size or 1 << 31, max_model_len=max_model_len, num_prompt_tokens=num_prompt
        )
    )
    return sampling


def _check(thunk: Callable[[], T]) -> T:
    try:
        return thunk()
    except InvalidRequestError as exc:
        raise errors.invalid(exc) from None


def _parse(decode: Callable[[bytes], T], body: bytes) -> T:
    return _check(lambda: decode(body))


def _json(payload: object, headers: Mapping[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json", headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 past ``limit``. The rest is read and dropped (up to a bound) rather than left
    unread: a client still writing when the answer comes would see a reset, not the 413."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > limit * BODY_DRAIN_FACTOR:
            break
    if size > limit:
        raise errors.body_too_large(limit)
    return b"".join(chunks)


# ---------------------------------------------------------------- server-sent events
# Starlette's StreamingResponse only notices a gone client when a write fails, and on ASGI 2.4 servers
# it does not even close the generator then. Here a second task watches ``receive`` for
# ``http.disconnect`` and cancels the stream at once, so the generator's ``async with stream`` sends the
# Abort that frees the request's KV blocks on its worker, even while it is waiting for the next token.

DONE = b"data: [DONE]\n\n"


def event(payload: object) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class EventStreamResponse(Response):
    """An ASGI response that sends each ``bytes`` from ``events`` as it comes (already SSE-framed)."""

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str]) -> None:
        # Not Response.__init__: that would fix a Content-Length for a body that does not exist yet.
        self.status_code = 200
        self.background = None
        self._events = events
        self._header_list = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            *((k.lower().encode(), v.encode()) for k, v in headers.items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._watch_disconnect, receive, group.cancel_scope)
                await send({"type": "http.response.start", "status": 200, "headers": self._header_list})
                async for chunk in self._events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                group.cancel_scope.cancel()  # done: stop watching
        except OSError:
            pass  # the client went away mid-write: nothing left to tell it
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # runs the generator's cleanup (the Abort) in every case

    @staticmethod
    async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()
