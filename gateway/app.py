"""The HTTP front: the OpenAI endpoints, ``/v1/models[/NAME]``, ``/health``, ``/ready`` and ``/metrics``.

Chat, completions and responses take one path; what differs between them (decoding, prompts, response
shapes) is an :class:`~gateway.endpoint.Endpoint`:

    headers ─▶ identity (tenant, tier; 401/400/403) ─▶ body ─▶ endpoint.decode (service_tier may set
        the tier) ─▶ endpoint.prompts ─▶ placement and tokens, decided once (gateway/placement.py)
        ─▶ prompt check per prompt (wire/prompt.py, against the workers that would take it)
        ─▶ Job (prompts × n choices)
        ─▶ completion.respond
                                         (admission, dispatch, fan-in, SSE or JSON: gateway/completion.py)

While draining (SIGTERM, see gateway/drain.py) the completion routes answer 503 and ``/ready`` 503.
Everything a client can get wrong is a 4xx raised as :class:`APIError` before any work is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from importlib.metadata import version as package_version
from typing import Any, TypeVar

import msgspec
from opentelemetry import trace
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import errors, tokenize_api
from gateway.completion import Choice, Job, respond
from gateway.drain import DrainMiddleware
from gateway.endpoint import CHAT, COMPLETIONS, RESPONSES, Body, Endpoint
from gateway.errors import APIError
from gateway.identity import Identity, identify, with_cache_salt, with_service_tier
from gateway.logprobs import TokenTexts
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.openai_api import EchoedPrompt, PromptScoring, Rendering
from gateway.openai_requests import ChatCompletionRequest, CompletionRequest
from gateway.openai_types import ModelCard, ModelList
from gateway.placement import place_prompts
from gateway.sse import ClientDisconnected
from gateway.state import Gateway, Placement
from gateway.tokenizer import bad_word_ids
from gateway.workers import WorkerState
from telemetry import attributes as attr
from telemetry.http import ServerSpanMiddleware
from wire.errors import InvalidRequestError
from wire.prompt import check_prompt
from wire.sampling import SamplingParams

__all__ = ["Gateway", "create_app"]

log = logging.getLogger(__name__)
T = TypeVar("T")

BODY_DRAIN_FACTOR = 16  # read (and discard) up to this many times the limit, so the client sees the 413
ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES)
COMPLETION_PATHS = frozenset(endpoint.path for endpoint in ENDPOINTS)  # refused while draining; waited for
CLIENT_CLOSED_REQUEST = 499  # never reaches anyone: the client is gone


def create_app(gateway: Gateway) -> Starlette:
    def completion_route(endpoint: Endpoint[Any]) -> Route:
        async def complete(request: Request) -> Response:
            return await _complete(request, gateway, endpoint)

        return Route(endpoint.path, complete, methods=["POST"])

    async def version(request: Request) -> Response:
        """vLLM's ``/version``: the server's package version."""
        return _json({"version": package_version("tierserve")})

    async def models(request: Request) -> Response:
        identify(gateway.config, request.headers)  # the completion routes' keys
        return _json(ModelList(data=[_model_card(gateway, name) for name in gateway.builders]))

    async def model(request: Request) -> Response:
        """OpenAI's retrieve (``client.models.retrieve``): one served model, else 404."""
        identify(gateway.config, request.headers)
        name = request.path_params["model"]
        gateway.builder(name)  # 404 model_not_found, naming the served ones
        return _json(_model_card(gateway, name))

    async def stored_response(request: Request) -> Response:
        """OpenAI's retrieve, delete, cancel and input_items of a stored response: none is stored here."""
        identify(gateway.config, request.headers)
        raise errors.response_not_stored(request.path_params["rest"].split("/")[0])

    async def health(request: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    async def ready(request: Request) -> Response:
        if gateway.drain.is_draining:
            return Response("draining\n", status_code=503, media_type="text/plain")
        num_ready = gateway.dispatcher.registry.num_in_state(WorkerState.READY)
        if num_ready == 0:
            return Response("no ready worker\n", status_code=503, media_type="text/plain")
        return Response(f"{num_ready} workers ready\n", media_type="text/plain")

    async def tokenize(request: Request) -> Response:
        identify(gateway.config, request.headers)  # the completion routes' keys
        raw = await _read_body(request, gateway.config.gateway.max_body_bytes)
        body = _parse(tokenize_api.decode_tokenize, raw)
        return _json(await _checked(tokenize_api.tokenize(gateway, body)))

    async def detokenize(request: Request) -> Response:
        identify(gateway.config, request.headers)
        raw = await _read_body(request, gateway.config.gateway.max_body_bytes)
        body = _parse(tokenize_api.decode_detokenize, raw)
        return _json(await _checked(tokenize_api.detokenize(gateway, body)))

    async def metrics(request: Request) -> Response:
        return Response(gateway.metrics.registry.render(), media_type=METRICS_CONTENT_TYPE)

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
            *(completion_route(endpoint) for endpoint in ENDPOINTS),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),  # names may hold "/" (org/name)
            Route("/v1/responses/{rest:path}", stored_response, methods=["GET", "POST", "DELETE"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_bug},
        middleware=[
            # Outermost: a request refused while draining still gets its server span.
            *_tracing_middleware(gateway),
            Middleware(DrainMiddleware, drain=gateway.drain, paths=COMPLETION_PATHS),
        ],
    )


def _tracing_middleware(gateway: Gateway) -> list[Middleware]:
    """The completion routes' server spans, only when tracing is on (off: not even a pass-through)."""
    if not gateway.telemetry.enabled:
        return []
    return [Middleware(ServerSpanMiddleware, tracer=gateway.telemetry.tracer, paths=COMPLETION_PATHS)]


def _classified(
    gateway: Gateway,
    span: trace.Span,
    identity: Identity,
    placement: Placement,
    prompts: Sequence[Sequence[int]],
) -> None:
    """What classification decided, on its span (the server span gets the same from the Job)."""
    if not span.is_recording():
        return
    num_tokens = max(len(p) for p in prompts) if prompts else 0
    span.set_attributes({
        attr.TIER: identity.tier.name,
        attr.TENANT: identity.tenant.name,
        attr.GEN_AI_REQUEST_MODEL: placement.requested,
        attr.DEGRADED: placement.is_degraded,
        attr.PROMPT_TOKENS: sum(len(p) for p in prompts),
        attr.CONTEXT_CLASS: gateway.config.gateway.context_class(num_tokens) if prompts else "",
    })  # fmt: skip


async def _complete(request: Request, gateway: Gateway, endpoint: Endpoint[Body]) -> Response:
    """The completion endpoints: classified (identity, body, prompts, placement, tokens) in the
    classify span, then admitted, run and answered by gateway/completion.py. An error names the field
    as the endpoint's API does."""
    try:
        return await _run(request, gateway, endpoint)
    except APIError as exc:
        if exc.param is None or endpoint.field_name(exc.param) == exc.param:
            raise
        raise exc.naming(endpoint.field_name(exc.param)) from None


async def _run(request: Request, gateway: Gateway, endpoint: Endpoint[Body]) -> Response:
    limits = gateway.config.gateway
    server_span = trace.get_current_span()  # telemetry/http.py's, or a no-op one
    with gateway.telemetry.tracer.start_as_current_span(attr.CLASSIFY) as span:
        identity = identify(gateway.config, request.headers)
        parsed = _parse(endpoint.decode, await _read_body(request, limits.max_body_bytes))
        identity = with_service_tier(gateway.config, identity, endpoint.service_tier(parsed))
        identity = with_cache_salt(identity, parsed.cache_salt)
        gateway.builder(parsed.model)  # 404 for a model not served here
        client_id = _answer_id(endpoint.id_prefix, request.headers, parsed.request_id)  # a 400 before work
        _check(lambda: parsed.check_n(limits.max_n))
        prompts = _check(lambda: endpoint.prompts(parsed, limits.max_prompts))
        seats = parsed.n * prompts.num_prompts
        placement, prompt_ids = await place_prompts(
            gateway, parsed.model, identity.tier, prompts, seats=seats
        )
        texts = _token_texts(gateway, placement.model, parsed) if endpoint.wants_logprobs(parsed) else None
        request_id = f"{endpoint.id_prefix}{uuid.uuid4().hex}"
        answer_id = client_id or request_id
        tool_spec = endpoint.tool_spec(parsed)
        if tool_spec is not None:  # read the answer as the placed model's template taught it
            call_format = gateway.builder(placement.model).call_format
            tool_spec = dataclasses.replace(tool_spec, answer_format=call_format)
        service_tier = gateway.config.service_tier_name(identity.tier)
        echo = None
        if endpoint.echo(parsed):
            echo = await _echoed(gateway, placement.model, prompts.texts, prompt_ids)
        num_scored = endpoint.prompt_logprobs(parsed)
        scoring = (
            None if num_scored is None else PromptScoring(gateway.token_texts(placement.model), num_scored)
        )
        rendering = Rendering(
            answer_id,
            placement.model,
            texts,
            tool_spec,
            service_tier,
            echo,
            scoring,
            prompt_ids if endpoint.return_token_ids(parsed) else None,
        )
        renderer = endpoint.renderer(parsed, rendering)
        _classified(gateway, span, identity, placement, prompt_ids)
        if gateway.telemetry.capture_content:
            server_span.set_attribute(attr.GEN_AI_INPUT_MESSAGES, json.dumps(prompts.content))
    model = placement.model
    choices = _choices(gateway, model, parsed, prompt_ids, prompts.param)
    await _checked(gateway.check_structured(choices[0].sampling.structured))  # every choice's is one
    job = Job(
        model,
        identity,
        choices,
        renderer,
        parsed.stream,
        limits.context_class(max(len(p) for p in prompt_ids)),
        endpoint.operation,
        request_id,
        requested_model=placement.requested,
        is_degraded=placement.is_degraded,
        priority=parsed.priority,
        continuous_usage=parsed.continuous_usage,
    )
    log.debug("request %s (answer %s): tenant %s, tier %s, model %s (asked for %s)", request_id, answer_id,
              identity.tenant.name, identity.tier.name, model, placement.requested)  # fmt: skip
    try:
        return await respond(gateway, job, request.receive)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)


CLIENT_REQUEST_ID = re.compile(r"[!-~]{1,128}")  # printable ASCII, no spaces: what proxies send


def _answer_id(prefix: str, headers: Mapping[str, str], field: str | None) -> str | None:
    """The answer's id named by the client, as vLLM names it (``chatcmpl-<id>``): from the
    ``X-Request-Id`` header a proxy or client set, else the body's ``request_id``; None when neither
    is given. The gateway's own id stays what its Submits, spans and logs key on: a client's need not
    be unique."""
    header = headers.get("x-request-id")
    given, param = (header, "X-Request-Id") if header is not None else (field, "request_id")
    if given is None:
        return None
    if not CLIENT_REQUEST_ID.fullmatch(given):
        raise APIError(400, f"{param}: at most 128 printable ASCII characters, no spaces", param=param)
    return f"{prefix}{given}"


def _model_card(gateway: Gateway, name: str) -> ModelCard:
    card = ModelCard(id=name, created=gateway.started_at)
    with contextlib.suppress(APIError):  # until a worker of it has registered: left out
        card.max_model_len = gateway.longest_context(name)
    return card


def _token_texts(
    gateway: Gateway, model: str, parsed: ChatCompletionRequest | CompletionRequest
) -> TokenTexts:
    """How logprobs name tokens: by their text, or (vLLM's ``return_tokens_as_token_ids``) as
    ``token_id:<id>``, which names every token uniquely whatever its bytes."""
    if parsed.return_tokens_as_token_ids:
        return TokenTexts(lambda token_id: f"token_id:{token_id}".encode())
    return gateway.token_texts(model)


async def _echoed(
    gateway: Gateway, model: str, texts: Sequence[str | None], prompt_ids: Sequence[Sequence[int]]
) -> list[EchoedPrompt]:
    """Each prompt as the legacy API's ``echo`` repeats it: the client's text, or its token ids
    decoded by the placed model's tokenizer (in a thread, as tokenizing is)."""
    builder = gateway.builder(model)
    return [
        EchoedPrompt(text if text is not None else await asyncio.to_thread(builder.decode, ids), ids[0])
        for text, ids in zip(texts, prompt_ids, strict=True)
    ]


def _choices(
    gateway: Gateway,
    model: str,
    parsed: ChatCompletionRequest | CompletionRequest,
    prompts: Sequence[Sequence[int]],
    param: str,
) -> list[Choice]:
    """``n`` choices per prompt, indexed prompt-major as OpenAI does. With a ``seed``, choice ``i`` of a
    prompt samples with ``seed + i``: reproducible, yet not ``n`` copies of one answer."""
    choices = []
    for prompt_index, prompt_ids in enumerate(prompts):
        sampling = _sampling(gateway, model, parsed, prompt_ids, param)
        for i in range(parsed.n):
            seeded = sampling
            if sampling.seed is not None and i:
                seeded = msgspec.structs.replace(sampling, seed=(sampling.seed + i) % (1 << 63))
            choices.append(Choice(prompt_index * parsed.n + i, prompt_index, list(prompt_ids), seeded))
    return choices


def _sampling(
    gateway: Gateway,
    model: str,
    parsed: ChatCompletionRequest | CompletionRequest,
    prompt_ids: Sequence[int],
    param: str,
) -> SamplingParams:
    """The prompt checked (wire/prompt.py) against the workers that would take it: those of its
    context class with room after it (none: 400, or 503 while they are only not ready). An empty
    prompt has no class to look them up by; ``check_prompt`` refuses it first."""
    num_prompt = len(prompt_ids)
    max_model_len, vocab_size = gateway.context_of(model, num_prompt, param) if num_prompt else (None, None)
    _check(lambda: check_prompt(prompt_ids, vocab_size=vocab_size, max_model_len=max_model_len, field=param))
    assert max_model_len is not None  # looked up for every prompt ``check_prompt`` lets through
    sampling = _check(lambda: parsed.to_sampling(max_model_len - num_prompt))
    if parsed.bad_words:  # as the placed model's tokenizer writes them
        words = _check(lambda: bad_word_ids(gateway.builder(model), parsed.bad_words or ()))
        sampling = msgspec.structs.replace(sampling, bad_words=words)
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


async def _checked(call: Awaitable[T]) -> T:
    try:
        return await call
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
