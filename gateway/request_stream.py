"""One request's side of dispatch: the in-flight record, the stream a caller iterates, and its errors.

The dispatcher owns every :class:`InFlight` and feeds its queue; a :class:`RequestStream` only reads
that queue and, when its consumer leaves early, asks the dispatcher (through ``on_abort``) to stop the
request on its worker. Errors travel through the same queue as tokens, so a stream never hangs.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from wire.messages import Submit, TokenDelta


class DispatchError(Exception):
    """Base of what a RequestStream (or submit) raises instead of a token."""


class NoWorkerAvailable(DispatchError):
    def __init__(self, model: str) -> None:
        super().__init__(f"no ready worker serves model {model!r}")
        self.model = model


class WorkerRejected(DispatchError):
    """The worker refused the Submit: answer with HTTP ``status`` and a message naming ``field``."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(f"{status} {field}: {message}")
        self.status = status
        self.field = field
        self.message = message


class WorkerLost(DispatchError):
    def __init__(self, worker_id: str, request_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id} lost while running request {request_id}: {reason}")
        self.worker_id = worker_id
        self.request_id = request_id
        self.reason = reason


class DispatcherClosed(DispatchError):
    pass


class RequestTimedOut(DispatchError):
    """The request ran past the gateway's ``request_timeout_s``."""


@dataclass(slots=True)
class InFlight:
    submit: Submit  # the attempt now running; a migration replaces it with epoch + 1
    model: str
    worker_id: str
    queue: asyncio.Queue[TokenDelta | DispatchError]
    token_ids: list[int] = dataclasses.field(default_factory=list)  # output delivered: what to resume from
    num_migrations: int = 0  # times it moved to another worker after losing one (gateway.max_migrations)
    context_class: str | None = None  # only workers taking this class run it (and its migrations)
    # The last placement as routing saw it (for the dispatch span): worker id → the policy's score, and
    # the prompt tokens the chosen worker's prefix index held (None: the policy does not use the index).
    route_scores: dict[str, float] = dataclasses.field(default_factory=dict)
    expected_cached_tokens: int | None = None

    @property
    def request_id(self) -> str:
        return self.submit.request_id


class RequestStream:
    """Async iterator over one request's TokenDeltas, ending after the one with a finish_reason.

    A lost worker's requests move to another worker (epoch + 1, resuming after the tokens already
    queued here), invisibly to the reader; :class:`WorkerLost` only when that is not possible (no
    healthy worker, or the migration limit reached). Raises :class:`WorkerRejected` or
    :class:`WorkerLost` instead of hanging. Leaving early (``aclose``,
    ``async with``, or the consuming task being cancelled while it waits) aborts the request on its
    worker, which frees its KV blocks. Breaking out of a bare ``async for`` does not: use ``async with``.
    """

    __slots__ = ("_is_done", "_on_abort", "_request")

    def __init__(self, request: InFlight, on_abort: Callable[[InFlight], None]) -> None:
        self._request = request
        self._on_abort = on_abort
        self._is_done = False

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def worker_id(self) -> str:
        return self._request.worker_id

    @property
    def epoch(self) -> int:
        return self._request.submit.epoch

    @property
    def route_scores(self) -> dict[str, float]:
        """Worker id → score, as the routing policy weighed them for the last placement (may be empty)."""
        return self._request.route_scores

    @property
    def expected_cached_tokens(self) -> int | None:
        return self._request.expected_cached_tokens

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._is_done:
            raise StopAsyncIteration
        try:
            item = await self._request.queue.get()
        except asyncio.CancelledError:
            self.abort()
            raise
        if isinstance(item, DispatchError):
            self._is_done = True
            raise item
        self._is_done = item.finish_reason is not None
        return item

    def fail(self, error: DispatchError) -> None:
        """Stop the request on its worker now and end the stream with ``error`` after what is already
        queued (a deadline passed)."""
        if not self._is_done:
            self._on_abort(self._request)  # the dispatcher forgets it: nothing more is queued after this
            self._request.queue.put_nowait(error)

    def abort(self) -> None:
        """Stop the request now (no-op once it has finished); what was queued is discarded."""
        if not self._is_done:
            self._is_done = True
            self._on_abort(self._request)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()
