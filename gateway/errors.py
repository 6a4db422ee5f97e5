"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Client mistakes are 4xx naming the field (``param``) to fix; a missing worker is 503; a worker lost
mid-request is 502. A 500 is only ever our own bug, never something a client sent.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from gateway.request_stream import (
    DispatchError,
    NoWorkerAvailable,
    RequestTimedOut,
    WorkerLost,
    WorkerRejected,
)
from wire.errors import InvalidRequestError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    504: "timeout_error",
    503: "service_unavailable",
}


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    error: ErrorDetail


class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into the JSON response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,  # e.g. WWW-Authenticate on a 401
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def naming(self, param: str) -> APIError:
        """The same error naming its field ``param`` (another API's name for it), in the message too."""
        message = self.message
        if self.param is not None and message.startswith(self.param):
            message = param + message[len(self.param) :]
        return APIError(self.status, message, param=param, code=self.code, headers=self.headers)

    def body(self) -> ErrorBody:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return ErrorBody(error=ErrorDetail(message=self.message, type=kind, param=self.param, code=self.code))

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return Response(
            msgspec.json.encode(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers={**self.headers, **(headers or {})},
        )


def invalid(exc: InvalidRequestError) -> APIError:
    return APIError(400, f"{exc.field}: {exc.message}", param=exc.field, code="invalid_value")


def unknown_model(model: str, served: list[str]) -> APIError:
    known = ", ".join(repr(name) for name in served) or "none yet"
    return APIError(
        404, f"model {model!r} is not served here (served: {known})", param="model", code="model_not_found"
    )


def response_not_stored(response_id: str) -> APIError:
    return APIError(
        404,
        f"response {response_id!r} is not stored here: the Responses API is served statelessly (store is "
        "false), so no response can be retrieved, deleted, cancelled or listed",
        code="not_found",
    )


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes", code="body_too_large")


def draining() -> APIError:
    # Connection: close so a keep-alive client reconnects, and its balancer picks another gateway.
    return APIError(
        503,
        "this gateway is shutting down; retry on another",
        code="draining",
        headers={"connection": "close"},
    )


def from_dispatch(exc: DispatchError) -> APIError:
    """What a failed submit or stream means for the client."""
    if isinstance(exc, WorkerRejected):
        # A worker's 4xx is a client mistake it caught; anything else it sends is passed on as is.
        return APIError(exc.status, f"{exc.field}: {exc.message}", param=exc.field)
    if isinstance(exc, NoWorkerAvailable):
        return APIError(503, str(exc), code="no_worker_available")
    if isinstance(exc, RequestTimedOut):
        return APIError(504, str(exc), code="timeout")
    if isinstance(exc, WorkerLost):
        return APIError(502, f"the worker running this request was lost: {exc.reason}", code="worker_lost")
    return APIError(503, str(exc), code="unavailable")  # DispatcherClosed: shutting down
