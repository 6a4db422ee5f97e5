"""Drive a workload at one or two servers on an arrival schedule, and collect the records.

    for each target, concurrently:        (a --compare run has two targets, the same schedule)
        for i, offset in schedule:        stop at --num-requests or once --duration has passed
            wait for a concurrency slot   (only with --concurrency; closed loop: every offset is 0)
            sleep until offset
            spawn send(request i)         the record lands in the result when it completes
        wait for what is in flight        (each request is bounded by --timeout)

Both targets get request ``i`` at the same offset, so in open loop their requests interleave and any
noise on the machine falls on both alike. Times are relative to one shared start.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from loadtest.arrivals import ArrivalSpec, arrival_offsets
from loadtest.client import RequestOptions, Target, send
from loadtest.progress import Progress
from loadtest.records import RequestRecord
from loadtest.workloads import Workload


@dataclass(frozen=True, slots=True)
class Bounds:
    max_requests: int | None  # per target
    duration_s: float | None  # no new request after this
    concurrency: int | None  # in-flight cap per target; with no rate, a closed loop

    def __post_init__(self) -> None:
        if self.max_requests is None and self.duration_s is None:
            raise ValueError("a run needs a bound: a request count, a duration, or both")


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]  # in completion order
    started_at: float  # wall clock (time.time()) at the shared start


def planned_requests(arrivals: ArrivalSpec, seed: int, bounds: Bounds) -> int | None:
    """How many requests the schedule holds, when that is known before the run (not for a closed loop
    bounded only by duration)."""
    if bounds.max_requests is not None:
        return bounds.max_requests
    if arrivals.rate is None:
        return None
    duration_s = bounds.duration_s
    assert duration_s is not None
    return len(list(itertools.takewhile(lambda t: t < duration_s, arrival_offsets(arrivals, seed))))


async def run_load(
    targets: Sequence[Target],
    workload: Workload,
    arrivals: ArrivalSpec,
    seed: int,
    bounds: Bounds,
    options: RequestOptions,
    progress: Progress | None = None,
    transport: httpx.AsyncBaseTransport | None = None,  # tests inject one; None: real sockets
) -> RunResult:
    planned = planned_requests(arrivals, seed, bounds)
    for i in range(planned or 0):  # tokenizing now keeps it out of the timed run
        workload.request(i)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: no proxy from the environment; traffic goes to the given URLs and nowhere else.
    async with httpx.AsyncClient(
        limits=limits,
        timeout=httpx.Timeout(options.timeout_s, connect=10.0),
        trust_env=False,
        transport=transport,
    ) as client:
        run = _Run(client, workload, arrivals, seed, bounds, options, time.perf_counter(), progress)
        started_at = time.time()
        ticker = asyncio.create_task(_tick(progress)) if progress is not None else None
        try:
            await asyncio.gather(*(run.drive(target) for target in targets))
        finally:
            if ticker is not None:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
    if progress is not None:
        progress.show(final=True)
    return RunResult(run.records, started_at)


@dataclass(slots=True)
class _Run:
    client: httpx.AsyncClient
    workload: Workload
    arrivals: ArrivalSpec
    seed: int
    bounds: Bounds
    options: RequestOptions
    t0: float  # perf_counter at the shared start
    progress: Progress | None
    records: list[RequestRecord] = field(default_factory=list)

    async def drive(self, target: Target) -> None:
        bounds = self.bounds
        slots = asyncio.Semaphore(bounds.concurrency) if bounds.concurrency else None
        in_flight: set[asyncio.Task[None]] = set()
        for index, offset in enumerate(arrival_offsets(self.arrivals, self.seed)):
            if bounds.max_requests is not None and index >= bounds.max_requests:
                break
            if bounds.duration_s is not None and offset >= bounds.duration_s:
                break
            if slots is not None:
                await slots.acquire()
            now = time.perf_counter() - self.t0
            if bounds.duration_s is not None and now >= bounds.duration_s:
                if slots is not None:
                    slots.release()
                break
            if offset > now:
                await asyncio.sleep(offset - now)
            if self.progress is not None:
                self.progress.on_sent()
            task = asyncio.create_task(self._one(target, index, slots))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.gather(*in_flight)

    async def _one(self, target: Target, index: int, slots: asyncio.Semaphore | None) -> None:
        try:
            record = await send(self.client, target, self.workload.request(index), self.options, self.t0)
            self.records.append(record)
            if self.progress is not None:
                self.progress.on_done(record)
        finally:
            if slots is not None:
                slots.release()


async def _tick(progress: Progress) -> None:
    while True:
        await asyncio.sleep(progress.interval_s)
        progress.show()
