"""The ``failover`` scenario: ``tierserve serve --mock 4``, streams in flight, ``kill -9`` one worker.

    tierserve bench failover --json [--streams 32] [--max-tokens 400] [--kill-after-s 0.5] [--seed 0]

Starts serve with four mock workers, opens ``--streams`` greedy streams at once, SIGKILLs one worker
(seeded choice) ``--kill-after-s`` into the run, and lets every stream finish. The mock's output is a
pure function of the prompt, so the no-failure transcript of each stream is simply the same request
asked again, unstreamed, after the run (on the surviving workers). Figures:

- ``lost_requests``: streams that did not end normally with all their tokens (an error event, a broken
  connection, a wrong finish);
- ``duplicated_tokens``: bytes (= tokens: the mock's tokenizer is byte-level) a stream received beyond
  its reference transcript; ``mismatched_streams``: streams whose text is not exactly the reference;
- ``max_stall_ms``: the longest gap any client saw between two chunks, kill included;
- ``recovery_s``: from the kill to the moment every stream that was still running had its next chunk;
- ``migrations``: requests the gateway moved (``tierserve_migrations_total``).

The helpers here (one streamed completion with its chunk times, the worker processes of a server, a
metric from ``/metrics``) are what ``tests/e2e/test_failover.py`` drives its trials with, and
``tests/e2e/test_failover_smollm2.py`` its trials with the real model.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest.launch import Server, log_tail, running_server

NUM_WORKERS = 4
READY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 120.0


@dataclass(slots=True)
class StreamResult:
    """What one streamed ``/v1/completions`` client saw."""

    prompt: str
    max_tokens: int
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)  # monotonic arrival of each text chunk
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None  # an error event, a non-200 status or a broken connection
    worker: str | None = None  # where the gateway first placed it (x-tierserve-worker)

    @property
    def is_complete(self) -> bool:
        return (
            self.error is None
            and self.finish_reason == "length"
            and self.completion_tokens == self.max_tokens
        )

    def max_gap_s(self) -> float:
        times = self.chunk_times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


async def stream_completion(
    http: httpx.AsyncClient,
    base_url: str,
    prompt: str,
    max_tokens: int,
    *,
    model: str = "mock",
    on_chunk: Callable[[StreamResult], None] | None = None,
) -> StreamResult:
    """One greedy streamed completion with usage; never raises for a failure, records it.

    ``on_chunk`` is called with the result so far after every text chunk: a caller can act at a
    given point of a stream (``tests/e2e/test_failover_smollm2.py`` kills a worker there)."""
    result = StreamResult(prompt, max_tokens)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            result.worker = response.headers.get("x-tierserve-worker")
            if response.status_code != 200:
                result.error = f"status {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    result.error = str(event["error"])
                    continue
                for choice in event.get("choices") or ():
                    if choice.get("text"):
                        result.text += choice["text"]
                        result.chunk_times.append(time.monotonic())
                        if on_chunk is not None:
                            on_chunk(result)
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                if event.get("usage"):
                    result.completion_tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def reference_text(
    http: httpx.AsyncClient, base_url: str, prompt: str, max_tokens: int, *, model: str = "mock"
) -> str:
    """The no-failure transcript: the same greedy request, unstreamed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = await http.post(f"{base_url}/v1/completions", json=body)
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


@dataclass(kw_only=True)
class Fleet:
    """A running serve's workers, plus the ones a test starts beside them (replacements, extras)."""

    server: Server
    address: str  # the gateway's ROUTER, where extra workers dial (serve_worker_address)
    log_dir: Path  # each extra worker's stderr goes to <log_dir>/<worker id>.log
    spawned: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)

    def live(self) -> dict[str, int]:
        """worker id → pid of every worker process still running."""
        found = {w: pid for w, pid in worker_processes(self.server).items() if w not in self.killed}
        found.update({w: p.pid for w, p in self.spawned.items() if p.poll() is None})
        return found

    def start(self, worker_id: str, worker_args: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        """``tierserve worker --connect <address> --worker-id <worker_id> *worker_args``."""
        command = [sys.executable, "-m", "worker.cli", "worker", "--connect", self.address,
                   "--worker-id", worker_id, *worker_args]  # fmt: skip
        with (self.log_dir / f"{worker_id}.log").open("ab") as log:
            self.spawned[worker_id] = subprocess.Popen(
                command, env=dict(env) if env is not None else None, stdout=subprocess.DEVNULL, stderr=log
            )

    def kill(self, worker_id: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal one worker; SIGKILL and SIGTERM count it gone (and reap it if we started it)."""
        os.kill(self.live()[worker_id], sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.killed.add(worker_id)
            if worker_id in self.spawned:
                self.spawned[worker_id].wait(20)

    def close(self) -> None:
        for process in self.spawned.values():
            if process.poll() is None:
                process.kill()
            process.wait(10)


def serve_worker_address(log_path: Path, model: str) -> str:
    """The address serve's workers of ``model`` dial, from the line serve prints when it starts them."""
    line = next(line for line in log_path.read_text().splitlines() if f"worker(s) of '{model}' on" in line)
    return line.split(" on ")[1].split()[0]


def worker_processes(server: Server) -> dict[str, int]:
    """worker id → pid of the workers serve started (from their command lines; Linux /proc)."""
    found = {}
    for pid in server.worker_pids():
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        if b"--worker-id" in args:
            found[args[args.index(b"--worker-id") + 1].decode()] = pid
    return found


def process_state(pid: int) -> str:
    """A process's state letter from /proc (``Z``: a zombie, exited), or "gone" (Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the Prometheus samples of ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(base_url: str) -> str:
    return httpx.get(f"{base_url}/metrics", timeout=5).text


def num_ready(base_url: str, model: str = "mock") -> int:
    return int(metric(scrape(base_url), "tierserve_worker_up", model=model, state="ready"))


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``predicate()`` until true; the seconds it took. TimeoutError naming ``what`` at the deadline."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not after {timeout_s} s")
        time.sleep(0.02)  # the poll interval of a deadline-bounded wait
    return time.monotonic() - start


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench failover", description=__doc__)
    parser.add_argument("--streams", type=int, default=32, help="streams in flight at the kill")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--kill-after-s", type=float, default=0.5, help="seconds into the run")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=3.0, help="gateway.heartbeat_timeout_s")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="failover-") as tmp:
        log_path = Path(tmp) / "serve.log"
        config = Path(tmp) / "tierserve.toml"
        config.write_text(
            f"[gateway]\nheartbeat_timeout_s = {args.heartbeat_timeout_s}\n"
            f"hang_timeout_s = {max(30.0, args.heartbeat_timeout_s)}\n"
        )
        serve_args = ["--mock", str(NUM_WORKERS), "--config", str(config)]
        try:
            with running_server(serve_args, log_path, READY_TIMEOUT_S) as server:
                # /ready answers once one worker is up; serve gives up if one dies before all are.
                wait_for(
                    lambda: num_ready(server.base_url) == NUM_WORKERS, READY_TIMEOUT_S, "4 workers ready"
                )
                return asyncio.run(_run(server, args, rng))
        except BaseException:
            print(f"[failover] the server's log ends with:\n{log_tail(log_path)}", file=sys.stderr)
            raise


async def _run(server: Server, args: argparse.Namespace, rng: random.Random) -> dict[str, object]:
    base_url = server.base_url
    prompts = [f"failover stream {i}, seed {args.seed}" for i in range(args.streams)]
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        tasks = [asyncio.create_task(stream_completion(http, base_url, p, args.max_tokens)) for p in prompts]
        await asyncio.sleep(args.kill_after_s)  # the moment of the kill is the scenario's parameter
        victim, pid = rng.choice(sorted(worker_processes(server).items()))
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.gather(*tasks)
        references = await asyncio.gather(
            *(reference_text(http, base_url, p, args.max_tokens) for p in prompts)
        )
    text = await asyncio.to_thread(scrape, base_url)
    lost = [r for r in results if not r.is_complete]
    duplicated = sum(
        max(0, len(r.text.encode()) - len(ref.encode())) for r, ref in zip(results, references, strict=True)
    )
    mismatched = sum(r.text != ref for r, ref in zip(results, references, strict=True))
    running_at_kill = [r for r in results if r.chunk_times and r.chunk_times[-1] > killed_at]
    recovery = max(
        (min(t for t in r.chunk_times if t > killed_at) - killed_at for r in running_at_kill), default=0.0
    )
    for r in lost[:3]:
        print(f"[failover] lost: {r.prompt!r}: {r.error or r.finish_reason}", file=sys.stderr)
    return {
        "scenario": "failover",
        "mock_workers": NUM_WORKERS,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "killed": victim,
        "kill_after_s": args.kill_after_s,
        "heartbeat_timeout_s": args.heartbeat_timeout_s,
        "lost_requests": len(lost),
        "duplicated_tokens": duplicated,
        "mismatched_streams": mismatched,
        "max_stall_ms": round(max(r.max_gap_s() for r in results) * 1e3, 1),
        "recovery_s": round(recovery, 3),
        "migrations": int(metric(text, "tierserve_migrations_total", model="mock")),
        "workers_lost": int(metric(text, "tierserve_workers_lost_total")),
    }
