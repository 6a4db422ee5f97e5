"""The ``tierserve`` command: the composition root, the one module that may import gateway and worker.

    tierserve serve ...                      the gateway and its worker processes (here)
    tierserve config show [--config FILE]    the effective configuration (``config_show.py``)
    tierserve keys generate DIR              a CURVE key pair for a worker link (here)
    tierserve models pull | generate | worker    the worker side (``worker/cli.py``; ``cli_parser.py``)
    tierserve load | bench                   the load generator and benchmarks (``loadtest/``)

``gateway/`` and ``worker/`` never import each other; the gateway starts workers as processes.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from worker import cli as worker_cli

if TYPE_CHECKING:
    from gateway.worker_procs import PoolLaunch
    from wire.config import ServerConfig

USAGE = """usage: tierserve {serve,config,keys,models,generate,worker,load,bench} ...

  serve      run the OpenAI-compatible gateway and its worker processes (--no-workers: gateway only)
  config     config show [--config FILE]: the effective configuration as TOML, defaults included
  keys       CURVE keys for the gateway-worker links (keys generate DIR)
  models     manage the local model cache (models pull)
  generate   answer one prompt in-process with the engine
  worker     run a worker daemon that dials a gateway over ZeroMQ (worker probe: its liveness check)
  load       drive an OpenAI-compatible server with a seeded workload; per-tier report and plots
  bench      run a named benchmark scenario (engine, peers, tiers, ...: bench --help lists them); --record

tierserve COMMAND --help for a command's options.
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "serve":
        return _serve(serve_parser().parse_args(argv[1:]))
    if argv[0] == "config" and argv[1:2] == ["show"]:
        from tierserve import config_show

        return config_show.main(argv[2:])
    if argv[0] == "keys":
        return _keys(_keys_parser().parse_args(argv[1:]))
    if argv[0] == "load":
        from loadtest import cli as load_cli  # lazy: serve and the worker never need httpx or matplotlib

        return load_cli.main(argv[1:])
    if argv[0] == "bench":
        from loadtest import bench

        return bench.main(argv[1:])
    return worker_cli.main(argv)


def serve_parser() -> argparse.ArgumentParser:
    """``serve``'s flags (deploy/'s manifests are checked against it: tests/deploy/)."""
    serve = argparse.ArgumentParser(
        prog="tierserve serve", description="run the OpenAI-compatible gateway and its worker processes"
    )
    serve.add_argument("--host", default=None, help="default: gateway.host from the config (127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="default: gateway.port from the config (8000)")
    serve.add_argument(
        "--model",
        default=None,
        help="the first primary pool's model instead of its path: a Hugging Face folder, or 'default' "
        "(SmolLM2-135M); served under the folder's name",
    )
    serve.add_argument(
        "--mock",
        type=int,
        default=0,
        metavar="N",
        help="simulated workers for every pool: N for the first primary, served as 'mock'; the other pools "
        "(a fallback) keep their names and num_workers",
    )
    serve.add_argument(
        "--mock-args",
        default="",
        metavar="ARGS",
        help="with --mock: more arguments for each mock worker (e.g. '--mock-token-ms 0.05')",
    )
    serve.add_argument(
        "--no-workers",
        action="store_true",
        help="start no worker processes: workers started elsewhere ('tierserve worker --connect ADDRESS', "
        "possibly shared with other gateways) dial gateway.worker_address, which must then be fixed",
    )
    serve.add_argument("--config", default=None, help="a TOML config file (else $TIERSERVE_CONFIG)")
    return serve


def _keys_parser() -> argparse.ArgumentParser:
    keys = argparse.ArgumentParser(prog="tierserve keys", description="CURVE keys for the worker links")
    sub = keys.add_subparsers(dest="keys_command", required=True)
    generate = sub.add_parser(
        "generate",
        help="write a new key pair: DIR/NAME.key (public: give it to the other side) and "
        "DIR/NAME.key_secret (secret: stays with its owner)",
    )
    generate.add_argument("dir", metavar="DIR", help="created (mode 0700) if missing")
    generate.add_argument("--name", default=None, help="file name stem (default: DIR's own name)")
    return keys


def _keys(args: argparse.Namespace) -> int:
    """``keys generate``: ZeroMQ's own certificate files (``zmq.auth.create_certificates``); never
    overwrites, and the secret file is readable by its owner only."""
    import os
    from pathlib import Path

    import zmq.auth

    folder = Path(args.dir)
    name = args.name or folder.resolve().name
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    existing = [str(path) for path in (public, secret) if path.exists()]
    if existing:
        print(f"error: will not overwrite {', '.join(existing)}", file=sys.stderr)
        return 2
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even for a moment
    try:
        zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old_umask)
    public.chmod(0o644)
    print(f"public key: {public}  (give it to the other side)\nsecret key: {secret}  (keep it here)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from gateway.serve import ServeOptions, check_policies, serve
    from policies.registry import PolicyError
    from wire.config import ConfigError, load_config
    from worker.models.store import ModelNotFoundError

    try:
        config = load_config(args.config)
        check_policies(config)
    except (ConfigError, PolicyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.no_workers and config.gateway.worker_address.endswith(":0"):
        print(
            "error: serve --no-workers needs a fixed gateway.worker_address for workers started elsewhere "
            "to dial (e.g. tcp://127.0.0.1:5555 or ipc:///run/tierserve/workers), not an ephemeral port",
            file=sys.stderr,
        )
        return 2
    try:
        options = ServeOptions(
            host=args.host or config.gateway.host,
            port=config.gateway.port if args.port is None else args.port,
            pools=_pools(args, config),
            config=config,
            launch_workers=not args.no_workers,
        )
    except (ModelNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(options)


def _pools(
    args: argparse.Namespace, config: ServerConfig, count_gpus: Callable[[], int] | None = None
) -> list[PoolLaunch]:
    """What serve starts for each configured pool (primary and fallback), each its own workers.

    ``--mock N``: mock workers everywhere; the first primary pool runs N of them served as "mock" (as
    with no config), every other pool its ``num_workers`` under its own name. Otherwise each pool runs
    its ``path`` under its ``name``, except that ``--model`` replaces the first primary's path and serves
    it under the folder's name. Pools of one model folder share a prompt builder. Pools sharing a served
    name (each taking some context classes) stay one model, their workers named after each pool.
    A pool on GPUs runs one worker per GPU (per ``tensor_parallel_size`` GPUs), each pinned to its own
    (tierserve/worker_plan.py); mock workers run one rank whatever the pool's size;
    ``count_gpus`` (default: torch's count, asked only when a pool may use a GPU) is a test's seam.
    """
    import os

    from gateway.tokenizer import BytePromptBuilder, HFPromptBuilder, PromptBuilder
    from gateway.worker_procs import PoolLaunch
    from tierserve.worker_plan import plan_workers, uses_gpus
    from worker.models.store import resolve_model

    num_gpus: int | None = None  # not counted: --mock, --no-workers, or CPU pools only
    if not args.mock and not args.no_workers and any(uses_gpus(pool) for pool in config.models.pools):
        if count_gpus is None:
            from worker.devices import count_visible_gpus  # imports torch

            count_gpus = count_visible_gpus
        num_gpus = count_gpus()

    pools = config.models.pools
    first_primary = next(i for i, pool in enumerate(pools) if pool.role == "primary")
    first_model = pools[first_primary].model_name
    num_sharing = Counter(pool.model_name for pool in pools)
    builders: dict[str, PromptBuilder] = {}
    launches = []
    for i, pool in enumerate(pools):
        is_first = pool.model_name == first_model  # the first primary, or a pool sharing its name
        prefix = pool.name if num_sharing[pool.model_name] > 1 else None  # worker ids stay unique
        if args.mock:
            builder = builders.setdefault("mock", BytePromptBuilder())
            name = "mock" if is_first else pool.model_name
            num_workers = args.mock if i == first_primary else plan_workers(pool, "", None, {}).num_workers
            worker_args = ["--mock", *shlex.split(args.mock_args)]
            one_rank = msgspec.structs.replace(pool, tensor_parallel_size=1)  # the mock has no shards
            launches.append(PoolLaunch(name, one_rank, builder, worker_args, num_workers, prefix))
            continue
        override = is_first and args.model is not None
        folder = resolve_model(args.model if override else pool.path)
        if str(folder) not in builders:
            builders[str(folder)] = HFPromptBuilder(folder)
        name = folder.name if override else pool.model_name
        plan = plan_workers(pool, f"models.pools[{i}]", num_gpus, os.environ)
        if plan.idle_gpus:
            print(
                f"note: models.pools[{i}] leaves GPUs {', '.join(plan.idle_gpus)} idle: fewer than its "
                f"tensor_parallel_size = {pool.tensor_parallel_size} (set devices or num_workers)",
                file=sys.stderr,
            )
        worker_args = ["--model", str(folder)]
        launches.append(
            PoolLaunch(
                name, pool, builders[str(folder)], worker_args, plan.num_workers, prefix, plan.worker_envs
            )
        )
    return launches
