"""Two ``tierserve worker --mock`` processes dialling a Dispatcher's ROUTER, for the dispatcher's tests
(test_dispatch.py, test_dispatch_failover.py; the ``fleet`` fixture is in conftest.py).

The workers live for a whole test module; each test runs its own Dispatcher (its own event loop, via
``asyncio.run``) on the same port, and the workers' DEALERs reconnect and re-Register by themselves.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.dispatch import Dispatcher, RequestStream
from gateway.workers import WorkerInfo
from policies.routing import RoutingPolicy
from wire.messages import TokenDelta
from wire.sampling import SamplingParams
from wire.tier import DEFAULT_TIERS
from worker.mock import MockTokenizer

MODEL = "mock"
WORKER_IDS = ("w1", "w2")
HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 1.5
START_TIMEOUT_S = 30.0  # two workers importing torch at once on a 2-core box
TEST_TIMEOUT_S = 20.0
TIER = DEFAULT_TIERS[0]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def prompt_ids(text: str) -> list[int]:
    return MockTokenizer().encode(text)


@dataclass
class Fleet:
    """Mock worker processes dialling ``address``; a killed one is restarted by :meth:`ensure_alive`."""

    address: str
    log_dir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def spawn(self, worker_id: str) -> None:
        stderr = (self.log_dir / f"{worker_id}.log").open("ab")
        self.processes[worker_id] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker.cli",
                "worker",
                "--mock",
                "--mock-step-ms",
                "2",
                "--heartbeat-interval",
                str(HEARTBEAT_INTERVAL_S),
                "--connect",
                self.address,
                "--worker-id",
                worker_id,
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        stderr.close()

    def ensure_alive(self) -> None:
        for worker_id in WORKER_IDS:
            process = self.processes.get(worker_id)
            if process is None or process.poll() is not None:
                self.spawn(worker_id)

    def kill(self, worker_id: str) -> None:
        process = self.processes[worker_id]
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        for process in self.processes.values():
            process.wait(10)


def run(
    fleet: Fleet,
    scenario: Callable[[Dispatcher], Awaitable[None]],
    *,
    max_migrations: int = 2,
    hang_timeout_s: float = 30.0,
    routing: RoutingPolicy | None = None,
) -> None:
    """Run ``scenario`` against a started Dispatcher that both workers have registered with."""
    fleet.ensure_alive()

    async def main() -> None:
        dispatcher = Dispatcher(
            fleet.address,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            hang_timeout_s=hang_timeout_s,
            max_migrations=max_migrations,
            routing=routing,
        )
        await dispatcher.start()
        try:
            await dispatcher.wait_for_workers(MODEL, len(WORKER_IDS), START_TIMEOUT_S)
            async with asyncio.timeout(TEST_TIMEOUT_S):
                await scenario(dispatcher)
        finally:
            await dispatcher.close()

    asyncio.run(main())


async def collect(stream: RequestStream) -> list[TokenDelta]:
    return [delta async for delta in stream]


def token_ids(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def worker_info(dispatcher: Dispatcher, worker_id: str) -> WorkerInfo:
    info = dispatcher.registry.get(worker_id)
    assert info is not None
    return info
