"""The client host of a namespaced fleet: an HTTP client that runs inside a network namespace and is
driven, one JSON line per command, over its stdin and stdout.

    ip netns exec <gateway's namespace> python -m loadtest.netns_client http://10.99.0.1:8000

Its sockets are made inside that namespace, so every request reaches the gateway over the namespace's
own interfaces, while the bench that drives it stays outside (it flips links, which no client could).
Commands and answers (each one line; an answer is ``{"error": ...}`` when a command fails):

    {"op": "metrics"}                                     → {"text": <the gateway's /metrics>}
    {"op": "start", "prompts": [...], "max_tokens": N, "model": M}   → {"num_streams": <all so far>}
    {"op": "progress"}    → {"streams": [{"worker", "num_chunks", "last_chunk_at", "is_done"}, ...]}
    {"op": "finish"}      → every stream started, once done: {"streams": [StreamResult fields, ...]}
    {"op": "reference", "prompts": [...], "max_tokens": N, "model": M}   → {"texts": [...]}

Streams are :func:`loadtest.failover_bench.stream_completion` (greedy, usage included); chunk times are
``time.monotonic()``, the machine's one clock, so the bench compares them with its own. EOF ends it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

import httpx

from loadtest.failover_bench import StreamResult, reference_text, stream_completion

REQUEST_TIMEOUT_S = 300.0


class _Client:
    def __init__(self, http: httpx.AsyncClient, base_url: str) -> None:
        self.http = http
        self.base_url = base_url
        self.partial: list[StreamResult | None] = []  # the result so far of each stream, once it has a chunk
        self.tasks: list[asyncio.Task[StreamResult]] = []

    async def handle(self, command: dict[str, object]) -> dict[str, object]:
        op = command["op"]
        if op == "metrics":
            response = await self.http.get(f"{self.base_url}/metrics", timeout=5)
            response.raise_for_status()
            return {"text": response.text}
        if op == "start":
            for prompt in _strings(command["prompts"]):
                self._start(prompt, int(str(command["max_tokens"])), str(command["model"]))
            return {"num_streams": len(self.tasks)}
        if op == "progress":
            return {"streams": [self._progress(i) for i in range(len(self.tasks))]}
        if op == "finish":
            results = await asyncio.gather(*self.tasks)
            return {"streams": [dataclasses.asdict(r) for r in results]}
        if op == "reference":
            texts = await asyncio.gather(
                *(
                    reference_text(
                        self.http,
                        self.base_url,
                        prompt,
                        int(str(command["max_tokens"])),
                        model=str(command["model"]),
                    )
                    for prompt in _strings(command["prompts"])
                )
            )
            return {"texts": list(texts)}
        raise ValueError(f"unknown op {op!r}")

    def _start(self, prompt: str, max_tokens: int, model: str) -> None:
        index = len(self.tasks)
        self.partial.append(None)

        def seen(result: StreamResult) -> None:
            self.partial[index] = result

        coroutine = stream_completion(
            self.http, self.base_url, prompt, max_tokens, model=model, on_chunk=seen
        )
        self.tasks.append(asyncio.create_task(coroutine))

    def _progress(self, index: int) -> dict[str, object]:
        task = self.tasks[index]
        result = task.result() if task.done() else self.partial[index]
        return {
            "worker": result.worker if result is not None else None,
            "num_chunks": len(result.chunk_times) if result is not None else 0,
            "last_chunk_at": result.chunk_times[-1] if result is not None and result.chunk_times else None,
            "is_done": task.done(),
        }


def _strings(value: object) -> list[str]:
    assert isinstance(value, list)
    return [str(v) for v in value]


async def serve_commands(base_url: str) -> None:
    # trust_env=False: no proxy from the environment; requests go to base_url and nowhere else.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits, trust_env=False) as http:
        client = _Client(http, base_url)
        while line := await asyncio.to_thread(sys.stdin.readline):
            try:
                answer = await client.handle(json.loads(line))
            except Exception as exc:  # reported to the bench, which decides (it retries /metrics)
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(serve_commands(sys.argv[1]))
