"""The ``tierserve`` command: the composition root, the one module that may import gateway and worker.

    tierserve serve ...                      the gateway and its worker processes (here)
    tierserve models pull | generate | worker    the worker side (``worker/cli.py``)
    tierserve load | bench                   the load generator and benchmarks (``loadtest/``)

``gateway/`` and ``worker/`` never import each other; the gateway starts workers as processes.
"""

from __future__ import annotations

import argparse
import sys

from worker import cli as worker_cli

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
        "--model", default="default", help="a Hugging Face folder, or 'default' (SmolLM2-135M)"
    )
    serve.add_argument("--mock", type=int, default=0, metavar="N", help="N simulated workers, model 'mock'")
    serve.add_argument("--config", default=None, help="a TOML config file (else $TIERSERVE_CONFIG)")
    return serve


def _serve(args: argparse.Namespace) -> int:
    from gateway.serve import ServeOptions, check_policies, serve
    from gateway.tokenizer import BytePromptBuilder, HFPromptBuilder, PromptBuilder
    from policies.registry import PolicyError
    from wire.config import ConfigError, load_config
    from worker.models.store import ModelNotFoundError, resolve_model

    try:
        config = load_config(args.config)
        check_policies(config)
    except (ConfigError, PolicyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    builder: PromptBuilder
    if args.mock:
        name, builder, worker_args, num_workers = "mock", BytePromptBuilder(), ["--mock"], args.mock
    else:
        try:
            folder = resolve_model(args.model)
        except ModelNotFoundError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        # The worker registers under its folder's name (the default model's folder is its name).
        name, builder, worker_args, num_workers = (
            folder.name,
            HFPromptBuilder(folder),
            ["--model", str(folder)],
            1,
        )
    options = ServeOptions(
        host=args.host or config.gateway.host,
        port=config.gateway.port if args.port is None else args.port,
        model_name=name,
        builder=builder,
        worker_args=worker_args,
        num_workers=num_workers,
        config=config,
    )
    return serve(options)
