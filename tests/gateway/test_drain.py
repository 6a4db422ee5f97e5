"""Drain and DrainMiddleware in process: a request counts for its whole ASGI call; refused while draining."""

from __future__ import annotations

import asyncio

import httpx
from starlette.types import Receive, Scope, Send

from gateway.drain import Drain, DrainMiddleware


def test_idle_until_the_last_request_leaves() -> None:
    async def main() -> None:
        drain = Drain()
        assert await drain.wait_idle(0.0)
        with drain.track(), drain.track():
            assert drain.num_in_flight == 2
            assert not await drain.wait_idle(0.01)
        assert drain.num_in_flight == 0
        assert await drain.wait_idle(1.0)

    asyncio.run(main())


def test_middleware_refuses_tracked_paths_only_while_draining() -> None:
    drain = Drain()
    seen: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(drain.num_in_flight)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> None:
        transport = httpx.ASGITransport(app=DrainMiddleware(app, drain, frozenset({"/work"})))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.post("/work")).status_code == 200
            drain.start()
            refused = await client.post("/work")
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "draining"
            assert refused.headers["connection"] == "close"
            assert (await client.get("/other")).status_code == 200

    asyncio.run(main())
    assert seen == [1, 0]  # counted on the tracked path, not on the other
