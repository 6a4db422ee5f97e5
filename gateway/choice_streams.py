"""A job's choices read as one stream: the RequestStreams of its Submits fanned in by choice index,
under one timer for the whole request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from gateway.request_stream import DispatchError, RequestStream, RequestTimedOut
from wire.messages import TokenDelta


class ChoiceStreams:
    """The RequestStreams of a job's choices read as one: ``(index, delta)`` as they arrive.

    Leaving early (``aclose``, or cancellation) aborts every choice still running. One choice is read
    directly; several are pumped into one queue by a task each.
    """

    def __init__(self, streams: Sequence[RequestStream], deadline: float) -> None:
        """``deadline``: event-loop time after which every stream ends with :class:`RequestTimedOut`."""
        self._streams = list(streams)
        self._queue: asyncio.Queue[tuple[int, TokenDelta | DispatchError]] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []
        self.pending: list[tuple[int, TokenDelta]] = []  # read ahead by ``first_of_each``
        if len(self._streams) > 1:
            self._pumps = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        # One timer for the whole request, not a timeout around every token.
        self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        for stream in self._streams:
            stream.fail(RequestTimedOut("the request took longer than the server's request timeout"))

    async def _pump(self, index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                self._queue.put_nowait((index, delta))
        except DispatchError as exc:
            self._queue.put_nowait((index, exc))

    async def _next(self) -> tuple[int, TokenDelta]:
        if len(self._streams) == 1:
            return 0, await anext(self._streams[0])
        index, item = await self._queue.get()
        if isinstance(item, DispatchError):
            raise item
        return index, item

    async def first_of_each(self) -> None:
        """Wait until every choice has answered once (so a refusal can still be a 4xx status)."""
        seen: set[int] = set()
        while len(seen) < len(self._streams):
            index, delta = await self._next()
            self.pending.append((index, delta))
            seen.add(index)

    def __aiter__(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        return self

    async def __anext__(self) -> tuple[int, TokenDelta]:
        if self.pending:
            return self.pending.pop(0)
        return await self._next()

    async def aclose(self) -> None:
        self._timer.cancel()
        for stream in self._streams:
            stream.abort()
        for pump in self._pumps:
            pump.cancel()
        if self._pumps:
            await asyncio.gather(*self._pumps, return_exceptions=True)
