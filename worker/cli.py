"""The worker side of the ``tierserve`` command line: ``models pull``, ``generate``, ``worker``,
``worker probe`` (the liveness check of a running worker, for a Kubernetes exec probe); their
arguments are ``worker/cli_parser.py``'s.

``tierserve serve`` (gateway + workers) is in ``tierserve/cli.py``, the one place that may import both
sides; ``python -m worker.cli worker`` is how the gateway starts its worker processes.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import socket
import sys
import time
from typing import TYPE_CHECKING

from policies.registry import PolicyError
from wire.errors import InvalidRequestError
from wire.sampling import SamplingParams
from worker.cli_parser import parse_args
from worker.cpu_isa import CpuIsaError, export_isa_env
from worker.policy_set import WorkerPolicies

if TYPE_CHECKING:
    from worker.config import EngineConfig
    from worker.daemon_io import CurveClientKeys
    from worker.tp_ranks import TensorParallelRanks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "probe":
        return _probe(args)
    try:
        export_isa_env()  # before torch computes anything, so ATen and oneDNN obey TIERSERVE_CPU_ISA too
    except CpuIsaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "models":
        from worker.models.store import pull_default_model

        pull_default_model(force=args.force)
        return 0
    if args.command == "worker":
        return _worker(args)
    return _generate(args)


def _probe(args: argparse.Namespace) -> int:
    from worker.liveness import check

    problem = check(args.liveness_file, args.max_age_s)
    if problem is not None:
        print(f"unhealthy: {problem}")  # the kubelet records a failed probe's output in the pod's events
        return 1
    return 0


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    from worker.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_gb=args.kv_cache_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cuda_graphs=False if args.no_cuda_graphs else None,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        cpu_kernels=not args.no_cpu_kernels,
        quant_activations=args.quant_activations,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        keep_full_precision=tuple(e.strip() for e in args.keep_full_precision.split(",") if e.strip()),
    )


def _worker(args: argparse.Namespace) -> int:
    from policies.feasibility import save_floor
    from telemetry import TelemetryConfigError, configure
    from worker.calibrate import measure_step_floor
    from worker.daemon import WorkerDaemon
    from worker.devices import describe_device
    from worker.engine import Engine
    from worker.liveness import NULL_LIVENESS, Liveness, LivenessFile
    from worker.models.store import step_floors_dir

    _configure_logging(args.verbose, args.log_file)
    if args.heartbeat_interval <= 0:
        print("error: --heartbeat-interval must be positive", file=sys.stderr)
        return 2
    liveness: Liveness = NULL_LIVENESS
    if args.liveness_file:
        try:  # before the model loads: an earlier run's file must not vouch for this one
            liveness = LivenessFile(args.liveness_file)
        except OSError as exc:
            print(f"error: --liveness-file: {exc}", file=sys.stderr)
            return 2
    config = _engine_config(args)
    try:
        addresses = _addresses(args.connect)
        curve = _curve_keys(args, len(addresses))
        policies = _policies(args.policies)
    except (ValueError, PolicyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.tensor_parallel_size < 1 or (args.mock and args.tensor_parallel_size > 1):
        print("error: --tensor-parallel-size must be at least 1, and 1 with --mock", file=sys.stderr)
        return 2
    engine: Engine
    ranks: TensorParallelRanks | None = None
    if args.mock:
        from worker.mock import MockCost, build_mock_engine  # lazy: torch-free tests never load it

        cost = MockCost(fixed_ms=args.mock_step_ms, per_token_ms=args.mock_token_ms)
        engine = build_mock_engine(
            config,
            cost,
            num_kv_blocks=args.mock_kv_blocks,
            max_model_len=args.max_model_len or 4096,  # the simulated model's own limit
            policies=policies,
        )
    else:
        try:
            if args.tensor_parallel_size > 1:
                from worker.tp_ranks import TensorParallelRanks

                ranks, config = TensorParallelRanks.start(config, args.tensor_parallel_size)
            engine = Engine.from_config(config, policies)
        except Exception as exc:  # a worker that cannot start says why in one line, then exits 1
            return _cannot_start(exc, args.log_file)
    logging.getLogger(__name__).info("policies: %s", engine.policies.describe())
    step_floor = None if args.no_calibrate else measure_step_floor(engine)
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    try:
        telemetry = configure("tierserve", "worker")  # serve passes its OTEL_* (and service name) down
    except TelemetryConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        daemon = WorkerDaemon(
            engine,
            addresses,
            worker_id,
            heartbeat_interval_s=args.heartbeat_interval,
            model_name=args.served_name or ("mock" if args.mock else None),
            telemetry=telemetry,
            context_classes=[c for c in args.context_classes.split(",") if c],
            curve=curve,
            orphan_timeout_s=args.orphan_timeout,
            step_floor=step_floor,
            liveness=liveness,
        )
        if step_floor is not None:
            device = describe_device(engine.runner.device)
            try:
                save_floor(step_floors_dir(), daemon.model_name, step_floor, device.name)
            except OSError as exc:  # only `tierserve config show` reads it: never a reason not to serve
                logging.getLogger(__name__).warning("could not save the step floor: %s", exc)
        freeze_startup_objects()
        return daemon.run()
    finally:
        if ranks is not None:
            ranks.close(engine.runner)  # the other ranks stop after the last step
        telemetry.shutdown()  # flush the last spans before the process goes


def freeze_startup_objects() -> None:
    """Everything start-up built (modules, weights' Python wrappers, tokenizer, policies) moves to the
    collector's permanent generation, so the full collections serving triggers stop walking it: in a
    32-stream decode profile of the Q4_1 default (2-core Zen 5) ``gc_collect_main`` was 4% of the
    samples, and none after the freeze. vLLM and SGLang freeze after start-up for the same reason."""
    gc.collect()
    gc.freeze()


# The choices a start makes (CPU level, dtype, packing) reach stderr at INFO even without -v.
STARTUP_LOGGERS = (
    "worker.cpu_isa",
    "worker.devices",
    "worker.kv_budget",
    "worker.precision",
    "worker.models.cpu_packing",
    "worker.models.cpu_linear",
    "kernels.cpu.build",
    "worker.model_runner",
    "worker.tp_ranks",
)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _configure_logging(verbose: bool, log_file: str | None) -> None:
    """stderr: warnings, the start-up choices, everything with -v; ``log_file``: INFO and up."""
    console = logging.StreamHandler()
    console.addFilter(lambda r: verbose or r.levelno >= logging.WARNING or r.name in STARTUP_LOGGERS)
    handlers: list[logging.Handler] = [console]
    if log_file:
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, handlers=handlers)


def _one_line(exc: BaseException) -> str:
    """``Type: message`` with the message's line breaks folded: what a failed start says."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _cannot_start(exc: Exception, log_file: str | None) -> int:
    """The cause in one line, after its traceback: on stderr, or, with a log file, only there (its last
    line, which serve shows as the worker's cause)."""
    import traceback

    line = f"cannot start: {_one_line(exc)}"
    if log_file:
        with open(log_file, "a") as out:
            traceback.print_exception(exc, file=out)
            out.write(line + "\n")
    else:
        traceback.print_exception(exc, file=sys.stderr)
        print(f"error: {line}", file=sys.stderr)
    return 1


def _addresses(given: list[str]) -> list[str]:
    """``--connect A --connect B,C`` → [A, B, C]: one link per gateway, each address once."""
    addresses = [a.strip() for arg in given for a in arg.split(",") if a.strip()]
    if not addresses:
        raise ValueError("--connect: no address given")
    for address in addresses:
        if not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--connect: expected tcp://HOST:PORT or ipc://PATH, got {address!r}")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"--connect: an address is given twice: {addresses}")
    return addresses


def _curve_keys(args: argparse.Namespace, num_links: int) -> CurveClientKeys | None:
    """The CURVE flags → the keys of every link; None when neither is given. ``ValueError`` (naming the
    flag and the file) for one without the other, a count that fits neither rule, or a bad file."""
    from wire.curve import CurveKeyError, load_key_pair, load_public_key
    from worker.daemon_io import CurveClientKeys

    secret_file, server_files = args.curve_secret_key_file, args.curve_server_key_file
    if secret_file is None and not server_files:
        return None
    if secret_file is None:
        raise ValueError("--curve-server-key-file needs --curve-secret-key-file (this worker's key pair)")
    if not server_files:
        raise ValueError("--curve-secret-key-file needs --curve-server-key-file (the gateway's public key)")
    if len(server_files) not in (1, num_links):
        raise ValueError(
            f"--curve-server-key-file: give it once (every gateway) or once per --connect ({num_links}), "
            f"not {len(server_files)} times"
        )
    try:
        key_pair = load_key_pair(secret_file)
    except CurveKeyError as exc:
        raise ValueError(f"--curve-secret-key-file: {exc}") from None
    try:
        server_keys = [load_public_key(path) for path in server_files]
    except CurveKeyError as exc:
        raise ValueError(f"--curve-server-key-file: {exc}") from None
    return CurveClientKeys(key_pair, tuple(server_keys * num_links if len(server_keys) == 1 else server_keys))


def _policies(text: str | None) -> WorkerPolicies:
    """``--policies`` JSON (what ``serve`` passes from the config's [policies]) → the worker's set;
    kinds not given (or no JSON at all): the configuration's defaults, the tiered set."""
    try:
        raw = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"--policies: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--policies: expected a JSON object")
    allow = raw.pop("allow_plugins", [])
    return WorkerPolicies.load(raw, allow_plugins=allow)


def _generate(args: argparse.Namespace) -> int:
    from worker.engine import Engine

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        engine = Engine.from_config(_engine_config(args))
    except Exception as exc:
        if args.verbose:
            raise
        print(f"error: cannot start the engine: {_one_line(exc)} (-v for the traceback)", file=sys.stderr)
        return 1
    prompt = (
        args.prompt if args.raw else engine.apply_chat_template([{"role": "user", "content": args.prompt}])
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    try:
        request_id = engine.add_request(prompt, params)
    except InvalidRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    num_tokens = 0
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id:
                num_tokens += len(output.new_token_ids)
                sys.stdout.write(output.text_delta)
                sys.stdout.flush()
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    if args.verbose:
        print(
            f"[{num_tokens} tokens in {elapsed:.2f} s, {num_tokens / elapsed:.1f} tokens/s]", file=sys.stderr
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
