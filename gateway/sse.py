"""Server-sent events out (each API's framing: the renderers' ``frame``, gateway/openai_api.py and
gateway/responses_api.py), and noticing a client that went away, for streamed and collected answers alike.

Starlette's StreamingResponse only notices a gone client when a write fails, and on ASGI 2.4 servers it
does not even close the generator then. Here a second task watches ``receive`` for ``http.disconnect``
and cancels the work at once: the generator's cleanup sends the Aborts that free the request's KV blocks
on its workers, even while it is waiting for the next token. :func:`until_disconnect` does the same for
work before a response exists (waiting in the admission queue, collecting a non-streamed answer).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready; nobody is left to answer."""


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    # After the body is read, the server's receive() blocks until the client disconnects.
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, cancelled (raising :class:`ClientDisconnected`) if the client leaves first.

    The work's own exception comes out as itself, not wrapped in a task group's ExceptionGroup.
    """
    results: list[T] = []
    errors: list[Exception] = []
    async with anyio.create_task_group() as group:
        group.start_soon(_watch_disconnect, receive, group.cancel_scope)
        try:
            results.append(await work)
        except Exception as exc:
            errors.append(exc)
        group.cancel_scope.cancel()  # done: stop watching
    if errors:
        raise errors[0]
    if not results:
        raise ClientDisconnected
    return results[0]


class EventStreamResponse(Response):
    """An ASGI response that sends each ``bytes`` from ``events`` as it comes (already SSE-framed)."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        headers: Mapping[str, str],
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``on_close`` runs after the events are closed, whether or not any was ever sent."""
        # Not Response.__init__: that would fix a Content-Length for a body that does not exist yet.
        self.status_code = 200
        self.background = None
        self._events = events
        self._on_close = on_close
        self._header_list = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            *((k.lower().encode(), v.encode()) for k, v in headers.items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_watch_disconnect, receive, group.cancel_scope)
                await send({"type": "http.response.start", "status": 200, "headers": self._header_list})
                async for chunk in self._events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                group.cancel_scope.cancel()  # done: stop watching
        except OSError:
            pass  # the client went away mid-write: nothing left to tell it
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # runs the generator's cleanup (the Aborts) if it started
                if self._on_close is not None:
                    await self._on_close()
