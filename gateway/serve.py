"""``tierserve serve``: one process that runs the gateway and owns its worker processes.

    serve ─┬─ Dispatcher (ROUTER on tcp://127.0.0.1:<ephemeral>)
           ├─ worker processes: python -m worker.cli worker --connect ... --served-name POOL
           │    (every configured pool, primary and fallback, its own workers; children, killed on exit)
           └─ uvicorn on host:port, /ready 503 until a worker has registered

Each pool's workers register under the pool's served name; the gateway serves every pool by name and
sends degraded requests for a primary to the fallback pool (``Gateway.fallbacks``).

Workers are started by command line (gateway/worker_procs.py); the gateway never imports the worker
package (it must stay torch-free). Shutdown (Ctrl-C, SIGTERM, or a worker dying before it was ever
ready) always runs the same ``finally``: stop uvicorn, SIGTERM the children (SIGKILL what is left),
then close the dispatcher (so no worker sees its link drop before its own signal).

SIGTERM drains first (what an orchestrator sends before it kills a pod): ``/ready`` and new completions
answer 503 at once, running requests finish for up to ``gateway.drain_timeout_s``, then the shutdown
above runs and the process exits 0. Ctrl-C (SIGINT), or a second SIGTERM, skips the drain: running
streams end at once with an error event, and a further signal stops without waiting for anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn
import zmq

from gateway.app import create_app
from gateway.dispatch import Dispatcher
from gateway.state import Gateway
from gateway.worker_link import worker_link
from gateway.worker_procs import (
    WORKER_POLICY_KINDS,
    PoolLaunch,
    WorkerProcess,
    spawn,
    stop_workers,
    threads_arg,
)
from gateway.workers import WorkerState
from policies.base import PolicyKind
from policies.registry import load_policy
from telemetry import Telemetry, TelemetryConfigError, configure
from wire.config import ServerConfig

# The start-up line's words once every worker serve expects is ready ("N/N workers ready; serving ..."):
# /ready answers 200 from the first one on; launchers that need the whole fleet wait for this line.
ALL_READY = "workers ready; serving"


@dataclass(slots=True)
class ServeOptions:
    host: str
    port: int
    pools: Sequence[PoolLaunch]  # the first primary is the one the start-up message shows
    config: ServerConfig
    ready_timeout_s: float = 600.0
    log_level: str = "warning"
    # False (serve --no-workers): start no workers; a fleet started elsewhere dials gateway.worker_address.
    launch_workers: bool = True

    def __post_init__(self) -> None:
        names = [launch.name for launch in self.pools if not launch.pool.context_classes]
        split = {launch.name for launch in self.pools if launch.pool.context_classes}
        if len(set(names)) != len(names) or set(names) & split:
            raise ValueError(f"two pools would serve the same model name for the same prompts: {names}")
        prefixes = [launch.worker_prefix or launch.name for launch in self.pools]
        if len(set(prefixes)) != len(prefixes):
            raise ValueError(f"two pools would name their workers alike: {prefixes}")
        if sum(launch.pool.role == "fallback" for launch in self.pools) > 1:
            raise ValueError("at most one fallback pool")
        if not any(launch.pool.role == "primary" for launch in self.pools):
            raise ValueError("at least one primary pool")

    @property
    def fallbacks(self) -> dict[str, str]:
        """Every primary pool's name → the fallback pool's name (none without a fallback pool)."""
        fallback = next((launch.name for launch in self.pools if launch.pool.role == "fallback"), None)
        if fallback is None:
            return {}
        return {launch.name: fallback for launch in self.pools if launch.pool.role == "primary"}

    @property
    def primary_name(self) -> str:
        return next(launch.name for launch in self.pools if launch.pool.role == "primary")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: it would re-raise SIGTERM after serving, killing this
    process before the ``finally`` that stops the workers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def serve(options: ServeOptions) -> int:
    try:
        telemetry = configure(options.config.telemetry.service_name, "gateway")
    except TelemetryConfigError as exc:
        _say(f"error: {exc}")
        return 2
    try:
        return asyncio.run(_serve(options, telemetry))
    finally:
        telemetry.shutdown()  # flush the last spans


async def _serve(options: ServeOptions, telemetry: Telemetry | None = None) -> int:
    with worker_link(options.config.gateway, own_workers=options.launch_workers) as link:
        if link.exposure_warning is not None:
            _say(f"warning: {link.exposure_warning}")
        limits = options.config.gateway
        try:
            dispatcher = Dispatcher(
                link.address,
                heartbeat_timeout_s=limits.heartbeat_timeout_s,
                hang_timeout_s=limits.hang_timeout_s,
                max_migrations=limits.max_migrations,
                curve=link.curve,
            )
        except zmq.ZMQError as exc:
            _say(f"error: cannot listen for workers on {link.address} (gateway.worker_address): {exc}")
            return 1
        _say(link.describe(dispatcher.address))
        try:  # before any worker starts: a port in use fails now, not after a model load
            http_socket = _http_socket(options.host, options.port)
        except OSError as exc:
            _say(f"error: cannot listen on {options.host}:{options.port}: {exc.strerror or exc}")
            await dispatcher.close()
            return 1
        with http_socket:
            return await _run(options, dispatcher, http_socket, link.worker_args, telemetry)


def _http_socket(host: str, port: int) -> socket.socket:
    """The HTTP listening socket, bound here and served by uvicorn. Made with ``IPPROTO_TCP`` named, as
    asyncio's own are: its transports set TCP_NODELAY only on sockets that say so, and with Nagle on
    the SSE tokens left in bursts (a 5 ms-a-token stream measured 3 ms between tokens)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def _run(
    options: ServeOptions,
    dispatcher: Dispatcher,
    http_socket: socket.socket,
    curve_args: list[str],
    telemetry: Telemetry | None,
) -> int:
    await dispatcher.start()
    workers: list[WorkerProcess] = []
    log_dir = Path(tempfile.mkdtemp(prefix="tierserve-workers-"))
    waiter: asyncio.Task[bool] | None = None
    drainer: asyncio.Task[None] | None = None
    try:
        threads = threads_arg(options.pools)
        for launch in options.pools if options.launch_workers else ():
            pins = [launch.env_of(i).get("CUDA_VISIBLE_DEVICES") for i in range(launch.num_workers)]
            gpus = f", CUDA_VISIBLE_DEVICES {' / '.join(p for p in pins if p)}" if any(pins) else ""
            ranks = (
                f", {launch.ranks_per_worker} tensor-parallel ranks each"
                if launch.ranks_per_worker > 1
                else ""
            )
            _say(
                f"starting {launch.num_workers} worker(s) of {launch.name!r} on {dispatcher.address} "
                f"({launch.pool.role} pool{ranks}{gpus})"
            )
            workers += [
                spawn(dispatcher.address, i, launch, options.config, log_dir, [*curve_args, *threads])
                for i in range(launch.num_workers)
            ]
        builders = {launch.name: launch.builder for launch in options.pools}
        gateway = Gateway(
            dispatcher,
            options.config,
            builders,
            int(time.time()),
            fallbacks=options.fallbacks,
            telemetry=telemetry or Telemetry.off(),
        )
        config = uvicorn.Config(
            create_app(gateway),
            host=options.host,
            port=options.port,
            log_level=options.log_level,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        server = _Server(config)
        loop = asyncio.get_running_loop()

        def on_sigterm() -> None:
            nonlocal drainer
            if drainer is not None:
                _stop_now(gateway, server)  # already draining: the caller wants us gone now
                return
            timeout_s = options.config.gateway.drain_timeout_s
            drainer = asyncio.create_task(_drain_then_exit(gateway, server, timeout_s))

        loop.add_signal_handler(signal.SIGINT, _stop_now, gateway, server)
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        waiter = asyncio.create_task(_wait_for_workers(dispatcher, workers, options, server))
        await server.serve(sockets=[http_socket])
        if not server.started:
            return 1  # uvicorn did not start; it said why
        return 0 if not waiter.done() or waiter.result() else 1
    finally:
        for task in (waiter, drainer):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        crashed = [w for w in workers if w.process.poll() not in (None, 0)]
        stop_workers(workers)  # before the dispatcher closes: no worker sees its link drop first
        await dispatcher.close()
        if crashed:
            _say(f"worker logs kept in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
        _say("stopped")


async def _drain_then_exit(gateway: Gateway, server: _Server, timeout_s: float) -> None:
    drain = gateway.drain
    drain.start()
    _say(f"SIGTERM: draining {drain.num_in_flight} request(s), for at most {timeout_s:g} s")
    if not await drain.wait_idle(timeout_s):
        _say(f"drain timed out with {drain.num_in_flight} request(s) running; ending them")
        _end_streams(gateway)
    server.should_exit = True


def _stop_now(gateway: Gateway, server: uvicorn.Server) -> None:
    """Ctrl-C, or a second SIGTERM: no drain. Running streams end with an error event at once, so their
    connections close and uvicorn stops without waiting for them; a further signal does not wait for
    anything."""
    if server.should_exit:
        server.force_exit = True
    _end_streams(gateway)
    server.should_exit = True


def _end_streams(gateway: Gateway) -> None:
    gateway.drain.start()  # nothing new is admitted meanwhile
    gateway.dispatcher.end_in_flight("the server is stopping")


async def _wait_for_workers(
    dispatcher: Dispatcher, workers: list[WorkerProcess], options: ServeOptions, server: _Server
) -> bool:
    """Report progress until every worker is ready; False (and stop serving) if one of ours exits or
    the deadline passes first. A fleet started elsewhere (``--no-workers``) has no deadline: the
    pools' worker counts are only what the progress lines expect."""

    def num_ready() -> int:
        return sum(
            dispatcher.registry.num_in_state(WorkerState.READY, launch.name) for launch in options.pools
        )

    expected = len(workers) if options.launch_workers else sum(launch.num_workers for launch in options.pools)
    if not options.launch_workers:
        _say(f"starting no workers: waiting for {expected} to dial {dispatcher.address}")
    deadline = time.monotonic() + options.ready_timeout_s if options.launch_workers else math.inf
    reported = -1
    while (ready := num_ready()) < expected:
        if ready != reported:
            _say(f"{ready}/{expected} workers ready")
            reported = ready
        dead = [w for w in workers if w.process.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = dead[0].start_failure() if dead else f"timed out after {options.ready_timeout_s:g} s"
            _say(f"error: workers not ready: {why}; stopping")
            server.should_exit = True
            return False
        # Wake on any registry change; the timeout is only so a crashed child is noticed.
        with contextlib.suppress(TimeoutError):
            await dispatcher.wait_until(lambda r=ready: num_ready() != r, timeout_s=1.0)  # type: ignore[misc]
    host = "127.0.0.1" if options.host in ("0.0.0.0", "::") else options.host
    names = ", ".join(repr(launch.name) for launch in options.pools)
    _say(f"{expected}/{expected} {ALL_READY} {names} on http://{host}:{options.port}")
    _say(
        f"try:\n  curl http://{host}:{options.port}/v1/chat/completions -H 'Content-Type: application/json' "
        f"""-d '{{"model": "{options.primary_name}", "messages": [{{"role": "user", "content": "Hi"}}]}}'"""
    )
    return True


GATEWAY_POLICY_KINDS: tuple[PolicyKind, ...] = ("admission", "routing", "degradation")


def check_policies(config: ServerConfig) -> None:
    """Load every policy the config selects, here, before any process starts: a plugin that is missing,
    not allowed, broken or given bad params stops startup with PolicyError naming it."""
    for kind in (*WORKER_POLICY_KINDS, *GATEWAY_POLICY_KINDS):
        selection = getattr(config.policies, kind)
        load_policy(kind, selection.name, selection.params, allow_plugins=config.policies.allow_plugins)


def _say(message: str) -> None:
    print(f"tierserve: {message}", file=sys.stderr, flush=True)
