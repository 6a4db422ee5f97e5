"""Graceful drain: after SIGTERM new completions get 503 while those already running finish.

``DrainMiddleware`` wraps the completion routes for the whole ASGI call, so a streaming response counts
as in flight until its last SSE event is sent, not just until the handler returns. ``serve`` calls
``Drain.start`` on SIGTERM and stops the server once ``wait_idle`` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import errors


class Drain:
    """Whether this gateway is draining, and how many tracked requests are still in flight."""

    def __init__(self) -> None:
        self.is_draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        self.is_draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight; False if ``timeout_s`` passes first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.num_in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_in_flight -= 1
            if self.num_in_flight == 0:
                self._idle.set()


class DrainMiddleware:
    """Refuses requests to ``paths`` with 503 while draining; counts the ones it lets through."""

    def __init__(self, app: ASGIApp, drain: Drain, paths: frozenset[str]) -> None:
        self.app = app
        self.drain = drain
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.drain.is_draining:
            await errors.draining().response()(scope, receive, send)
            return
        with self.drain.track():
            await self.app(scope, receive, send)
