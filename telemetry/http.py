"""The server span of an HTTP request, as an ASGI middleware (HTTP semantic conventions).

    incoming traceparent (if any) ─▶ SERVER span "POST /v1/chat/completions" (current while the app runs,
    streamed bodies included) ─▶ http.response.status_code; 5xx or an exception → status ERROR

Only ``paths`` are traced (the completion routes): ``/metrics`` scrapes and health checks are noise.
Handlers add their own attributes to ``trace.get_current_span()``.
"""

from __future__ import annotations

from collections.abc import Collection

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from telemetry.propagation import extract


class ServerSpanMiddleware:
    def __init__(self, app: ASGIApp, *, tracer: trace.Tracer, paths: Collection[str]) -> None:
        self.app = app
        self.tracer = tracer
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        method = scope["method"]
        route = scope["path"]
        attributes: dict[str, str | int] = {
            "http.request.method": method,
            "http.route": route,
            "url.path": route,
            "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", "1.1"),
        }
        if scope.get("server"):
            attributes["server.address"], attributes["server.port"] = scope["server"]
        if scope.get("client"):
            attributes["client.address"], attributes["client.port"] = scope["client"]
        if "user-agent" in headers:
            attributes["user_agent.original"] = headers["user-agent"]
        span = self.tracer.start_span(
            f"{method} {route}", context=extract(headers), kind=SpanKind.SERVER, attributes=attributes
        )
        status_code: int | None = None

        async def send_with_status(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
                span.set_attribute("http.response.status_code", status_code)
            await send(message)

        with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
            try:
                await self.app(scope, receive, send_with_status)
            except BaseException as exc:
                span.set_attribute("error.type", type(exc).__qualname__)
                span.set_status(Status(StatusCode.ERROR, type(exc).__qualname__))
                raise
            if status_code is not None and status_code >= 500:
                span.set_attribute("error.type", str(status_code))
                span.set_status(Status(StatusCode.ERROR))
