"""The ``tierserve`` command: the composition root, the one module that may import gateway and worker.

    tierserve serve ...                      the gateway and its worker processes (here)
    tierserve models pull | generate | worker    the worker side (``worker/cli.py``)
    tierserve load | bench                   the load generator and benchmarks (``loadtest/``)

``gateway/`` and ``worker/`` never import each other; the gateway starts workers as processes.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import Counter
from typing import TYPE_CHECKING

from worker import cli as worker_cli

if TYPE_CHECKING:
    from gateway.serve import PoolLaunch
    from wire.config import ServerConfig

USAGE = """usage: tierserve {serve,models,generate,worker,load,bench} ...

  serve      run the OpenAI-compatible gateway and its worker processes
  models     manage the local model cache (models pull)
  generate   answer one prompt in-process with the engine
  worker     run a worker daemon that dials a gateway over ZeroMQ
  load       drive an OpenAI-compatible server with a seeded workload; per-tier report and plots
  bench      run a named benchmark scenario (engine, gateway-overhead, load-smoke); --record

tierserve COMMAND --help for a command's options.
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "serve":
        return _serve(_serve_parser().parse_args(argv[1:]))
    if argv[0] == "load":
        from loadtest import cli as load_cli  # lazy: serve and the worker never need httpx or matplotlib

        return load_cli.main(argv[1:])
    if argv[0] == "bench":
        from loadtest import bench

        return bench.main(argv[1:])
    return worker_cli.main(argv)


def _serve_parser() -> argparse.ArgumentParser:
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
    serve.add_argument("--config", default=None, help="a TOML config file (else $TIERSERVE_CONFIG)")
    return serve


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
    try:
        options = ServeOptions(
            host=args.host or config.gateway.host,
            port=config.gateway.port if args.port is None else args.port,
            pools=_pools(args, config),
            config=config,
        )
    except (ModelNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(options)


def _pools(args: argparse.Namespace, config: ServerConfig) -> list[PoolLaunch]:
    """What serve starts for each configured pool (primary and fallback), each its own workers.

    ``--mock N``: mock workers everywhere; the first primary pool runs N of them served as "mock" (as
    with no config), every other pool its ``num_workers`` under its own name. Otherwise each pool runs
    its ``path`` under its ``name``, except that ``--model`` replaces the first primary's path and serves
    it under the folder's name. Pools of one model folder share a prompt builder. Pools sharing a served
    name (each taking some context classes) stay one model, their workers named after each pool.
    """
    from gateway.serve import PoolLaunch
    from gateway.tokenizer import BytePromptBuilder, HFPromptBuilder, PromptBuilder
    from worker.models.store import resolve_model

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
            num_workers = args.mock if i == first_primary else pool.num_workers
            worker_args = ["--mock", *shlex.split(args.mock_args)]
            launches.append(PoolLaunch(name, pool, builder, worker_args, num_workers, prefix))
            continue
        override = is_first and args.model is not None
        folder = resolve_model(args.model if override else pool.path)
        if str(folder) not in builders:
            builders[str(folder)] = HFPromptBuilder(folder)
        name = folder.name if override else pool.model_name
        launches.append(
            PoolLaunch(name, pool, builders[str(folder)], ["--model", str(folder)], pool.num_workers, prefix)
        )
    return launches
