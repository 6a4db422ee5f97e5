"""The worker side's command-line grammar: ``models pull``, ``generate``, ``worker`` and ``worker probe``
(its own parser, since ``worker`` requires ``--connect``). Torch-free, so ``--help`` is quick and the
deploy tests can parse the manifests' command lines; ``worker/cli.py`` runs what is parsed.
"""

from __future__ import annotations

import argparse
import sys

from wire.config import DEFAULT_MODEL_PATH


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL_PATH,
        help="a Hugging Face folder, a GGUF file, 'default-q4_1' (SmolLM2-135M from its Q4_1 GGUF: the "
        "default) or 'default' (its float weights)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="auto: bf16 on CUDA and on CPUs with native bf16, float32 on other CPUs",
    )
    parser.add_argument(
        "--device",
        default="auto",
        type=_device,
        metavar="{auto,cpu,cuda,cuda:N}",
        help="auto (the default): cuda when a CUDA device is visible, else cpu",
    )
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="memory for the paged KV cache (default: 1 GiB on CPU; on CUDA what "
        "--gpu-memory-utilization leaves after the weights and a warm-up step)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="without --kv-cache-gb, on CUDA: the fraction of the GPU's memory in use once the KV cache "
        "is allocated (0 < F <= 1; other processes on the GPU count too)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="run decode steps eagerly on CUDA (default: replay captured CUDA graphs)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context limit in tokens (default: the model's own)"
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--no-cpu-kernels", action="store_true", help="torch's matmuls only, not our C kernels (to compare)"
    )
    parser.add_argument(
        "--quantization",
        choices=("none", "int8", "int4"),  # worker.config.QUANTIZATIONS
        default="none",
        help="quantize a float checkpoint's linears at load: int8 (Q8_0 blocks) or int4 (Q4_1 groups of 32)",
    )
    parser.add_argument(
        "--keep-full-precision",
        default="",
        help="modules of a quantized model kept in float, comma-separated: attention, mlp, lm_head, a "
        "projection (qkv_proj, o_proj, gate_up_proj, down_proj), layers.N or layers.N.<projection>",
    )
    parser.add_argument(
        "--quant-activations",
        choices=("int16", "int8"),  # worker.config.QUANT_ACTIVATIONS (not imported here: torch)
        default="int16",
        help="a GGUF model's linears quantize their input to int16 (close to float) or int8 (llama.cpp's)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "bfloat16"),  # worker.config.KV_CACHE_DTYPES
        default="auto",
        help="the KV cache's dtype: auto (the model's), or bfloat16 under a float32 or quantized model on "
        "CPU (half the bytes attention reads, twice the tokens a budget holds)",
    )


def _device(text: str) -> str:
    from worker.devices import check_device  # torch-free

    try:
        return check_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """``models``, ``generate`` and ``worker`` with their flags (serve's ``pool_args`` must parse here)."""
    parser = argparse.ArgumentParser(prog="tierserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage the local model cache")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    pull = models_sub.add_parser("pull", help="fetch and convert the embedded default model")
    pull.add_argument("--force", action="store_true", help="convert again even if present")

    gen = sub.add_parser("generate", help="answer one prompt in-process with the engine")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template: complete the text as is")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("-v", "--verbose", action="store_true")
    _add_engine_args(gen)

    worker = sub.add_parser("worker", help="run a worker daemon that dials a gateway over ZeroMQ")
    worker.add_argument(
        "--connect",
        required=True,
        action="append",
        metavar="ADDRESS",
        help="a gateway's worker address (tcp://HOST:PORT or ipc://PATH); repeat it, or separate with "
        "commas, to serve several gateways",
    )
    worker.add_argument("--worker-id", default=None, help="identity on the gateway (default: host-pid)")
    worker.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds between heartbeats")
    worker.add_argument(
        "--orphan-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="abort a gateway's requests once its link has been down this long",
    )
    worker.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip measuring the step floor at start (a prefill and a few decodes alone; "
        "the gateway then cannot say whether this machine meets each tier's targets)",
    )
    worker.add_argument(
        "--served-name",
        default=None,
        metavar="NAME",
        help="the model name to register under (default: 'mock' with --mock, else the model folder's name)",
    )
    worker.add_argument("--mock", action="store_true", help="a simulated model: no weights, timed steps")
    worker.add_argument("--mock-step-ms", type=float, default=5.0, help="with --mock: fixed time per step")
    worker.add_argument(
        "--mock-token-ms",
        type=float,
        default=0.0,
        help="with --mock: time per scheduled token (prefill cost)",
    )
    worker.add_argument("--mock-kv-blocks", type=int, default=512, help="with --mock: KV blocks of 16 tokens")
    worker.add_argument(
        "--policies",
        default=None,
        metavar="JSON",
        help='worker policies: {"ordering": {"name": "tiered", "params": {}}, ..., "allow_plugins": [...]}',
    )
    worker.add_argument(
        "--context-classes",
        default="",
        metavar="A,B",
        help="the gateway's context classes this worker takes (default: every class)",
    )
    worker.add_argument(
        "--curve-secret-key-file",
        default=None,
        metavar="PATH",
        help="CURVE: this worker's key pair (a .key_secret file from 'tierserve keys generate')",
    )
    worker.add_argument(
        "--curve-server-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="CURVE: the gateway's public key (.key file); once for every gateway, or once per --connect",
    )
    worker.add_argument(
        "--liveness-file",
        default=None,
        metavar="PATH",
        help="touch PATH whenever the loop makes progress (a finished step, an idle wait); "
        "'tierserve worker probe' checks its age (a stuck engine lets it go stale)",
    )
    worker.add_argument(
        "--log-file",
        default=None,
        metavar="PATH",
        help="also log here (INFO and up); a failed start ends it with one line: 'cannot start: ...'",
    )
    worker.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split a float model across N ranks: this process and N-1 it starts (gloo on CPU, NCCL on "
        "CUDA: rank r on cuda:r); one rank exiting stops the worker",
    )
    worker.add_argument("-v", "--verbose", action="store_true")
    _add_engine_args(worker)
    return parser


def build_probe_parser() -> argparse.ArgumentParser:
    """``worker probe``: its own parser, since ``worker`` itself requires ``--connect``."""
    probe = argparse.ArgumentParser(
        prog="tierserve worker probe",
        description="exit 0 when the worker's loop made progress within --max-age-s, else 1 saying why "
        "(a liveness probe: an idle worker passes, an engine stuck in a step fails)",
    )
    probe.add_argument("--liveness-file", required=True, metavar="PATH", help="the worker's --liveness-file")
    probe.add_argument(
        "--max-age-s",
        type=_positive_seconds,
        required=True,
        metavar="S",
        help="the longest a step may legitimately take (keep it above gateway.hang_timeout_s)",
    )
    return probe


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line ``main`` runs, parsed: ``worker probe ...`` by ``build_probe_parser`` (its
    ``command`` is ``"probe"``), everything else by ``build_parser``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["worker", "probe"]:
        args = build_probe_parser().parse_args(argv[2:])
        args.command = "probe"
        return args
    return build_parser().parse_args(argv)
