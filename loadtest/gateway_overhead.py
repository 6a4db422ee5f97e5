"""Gateway overhead: the whole stack (``tierserve serve`` over HTTP/SSE) vs the engine in-process.

    python -m loadtest.gateway_overhead --json

One run on one machine, the same model (the embedded one, bf16, unless ``--model``) on both sides, never
both at once (the server is stopped before the in-process engine is loaded):
  (a) single stream: one streamed chat request (fixed prompt, temperature 0) through the stack, and the
      same prompt ids (the engine's chat template) with the same sampling through ``engine.step()``.
      TPOT as vLLM defines it: (t_last - t_first) / (n - 1), n the output tokens. On the stack t_first
      is the first chunk carrying text, t_last the chunk carrying finish_reason and n is the usage's
      completion_tokens; in-process they are the steps that returned the first and the last token.
  (b) concurrency: ``--num-streams`` distinct prompts at once (asyncio + httpx) through
      the stack vs the same requests added at once to the engine: output tokens / wall time.
EOS is not ignorable over the API, so neither side ignores it: both count the tokens that arrived.
Both sides are warmed up first. Load goes to 127.0.0.1 only; the server (``loadtest.launch``) runs in its
own process group, killed in a ``finally``. ``--mock N`` runs N mock workers and the in-process mock
engine (same step cost) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import msgspec

from loadtest.launch import free_port, log_tail, running_server
from loadtest.sse import SSEParser

if TYPE_CHECKING:
    from worker.engine import Engine

SINGLE_PROMPT = (
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle. "
    "Describe every day of the week in detail."
)
TOPICS = [
    "a lighthouse", "the moon", "a river", "a mountain", "a city at night", "a desert", "an old library",
    "a train journey", "a garden", "the ocean", "a forest", "a snowstorm", "a market", "a volcano",
    "a spaceship", "a castle",
]  # fmt: skip
MOCK_STEP_MS = 5.0  # what `worker --mock` charges a step unless told otherwise (worker/cli.py)
REQUEST_TIMEOUT_S = 300.0
_decode = msgspec.json.Decoder().decode
READY_TIMEOUT_S = 600.0


def progress(message: str) -> None:
    print(f"[gateway_overhead] {message}", file=sys.stderr, flush=True)


def concurrent_prompt(i: int) -> str:
    return f"Request {i}: write a long story about {TOPICS[i % len(TOPICS)]}, number {i}."


def tpot_ms(t_first: float, t_last: float, num_tokens: int) -> float:
    """vLLM's time per output token (the first token excluded); NaN when fewer than 2 tokens."""
    return (t_last - t_first) / (num_tokens - 1) * 1e3 if num_tokens > 1 else float("nan")


# ---------------------------------------------------------------- the stack


@dataclass(slots=True)
class StreamResult:
    num_tokens: int  # the usage's completion_tokens
    t_first: float  # first chunk carrying text
    t_last: float  # the chunk carrying finish_reason
    finish_reason: str | None


async def stream_chat(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> StreamResult:
    """One streamed chat completion, read with httpx and loadtest's own SSE parser.

    The client runs on the same two cores as the server and the worker, so it must cost little per
    token: like vLLM's benchmark (aiohttp, hand-parsed SSE), not the openai SDK, which builds a
    pydantic object per chunk (about twice the CPU). The SDK itself is exercised by the e2e tests.
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t_first = t_last = float("nan")
    num_tokens = 0
    finish: str | None = None
    parser = SSEParser()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.aiter_raw():
            now = time.perf_counter()
            for data in parser.feed(raw):
                if data == b"[DONE]":
                    continue
                chunk = _decode(data)
                usage = chunk.get("usage")
                if usage:
                    num_tokens = usage["completion_tokens"]
                for choice in chunk["choices"]:
                    if choice["delta"].get("content") and t_first != t_first:  # NaN: not set yet
                        t_first = now
                    if choice.get("finish_reason") is not None:
                        t_last, finish = now, choice["finish_reason"]
    return StreamResult(num_tokens, t_first, t_last, finish)


async def measure_stack(
    url: str, single_tokens: int, num_streams: int, max_tokens: int
) -> tuple[StreamResult, float, list[StreamResult]]:
    """(single-stream result, concurrent tok/s, concurrent results)."""
    limits = httpx.Limits(max_connections=num_streams + 8, max_keepalive_connections=num_streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        progress(f"stack: model {model!r}; warming up")
        await stream_chat(client, model, SINGLE_PROMPT, 8)
        await asyncio.gather(*(stream_chat(client, model, concurrent_prompt(i), 4) for i in range(4)))
        single = await stream_chat(client, model, SINGLE_PROMPT, single_tokens)
        progress(f"stack single stream: {single.num_tokens} tokens, {_fmt_tpot(single)} ms/token")
        start = time.perf_counter()
        results = await asyncio.gather(
            *(stream_chat(client, model, concurrent_prompt(i), max_tokens) for i in range(num_streams))
        )
        elapsed = time.perf_counter() - start
        tok_s = sum(r.num_tokens for r in results) / elapsed
        progress(f"stack {num_streams} streams: {tok_s:.1f} tok/s over {elapsed:.2f} s")
        return single, tok_s, list(results)


def _fmt_tpot(result: StreamResult) -> str:
    return f"{tpot_ms(result.t_first, result.t_last, result.num_tokens):.2f}"


# ---------------------------------------------------------------- the engine in-process


def build_engine(model: str, mock: bool) -> Engine:
    from worker.config import EngineConfig

    # The defaults `tierserve worker` runs with (worker/cli.py): dtype auto, 1 GB KV, 64 seqs, 2048 tokens.
    config = EngineConfig(model=model)
    if mock:
        from worker.mock import MockCost, build_mock_engine

        return build_mock_engine(config, MockCost(fixed_ms=MOCK_STEP_MS))
    from worker.engine import Engine

    return Engine.from_config(config)


@dataclass(slots=True)
class EngineRun:
    tokens: dict[str, int]
    t_first: dict[str, float]
    t_last: dict[str, float]
    finished: int
    elapsed_s: float


def run_engine(engine: Engine, prompts: list[str], max_tokens: int) -> EngineRun:
    """Add every prompt (chat-templated) at once and step until all finish, timing each token."""
    from wire.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    start = time.perf_counter()
    request_ids = [engine.add_request(i, params) for i in ids]
    run = EngineRun({r: 0 for r in request_ids}, {}, {}, 0, 0.0)
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.new_token_ids:
                run.tokens[output.request_id] += len(output.new_token_ids)
                run.t_first.setdefault(output.request_id, now)
                run.t_last[output.request_id] = now
            if output.is_finished:
                run.finished += 1
    run.elapsed_s = time.perf_counter() - start
    return run


def measure_engine(
    engine: Engine, single_tokens: int, num_streams: int, max_tokens: int
) -> tuple[float, int, float, EngineRun]:
    """(single TPOT ms, single tokens, concurrent tok/s, concurrent run)."""
    progress("engine: warming up")
    run_engine(engine, [SINGLE_PROMPT], 8)
    run_engine(engine, [concurrent_prompt(i) for i in range(4)], 4)
    single = run_engine(engine, [SINGLE_PROMPT], single_tokens)
    (rid,) = single.tokens
    single_tpot = tpot_ms(single.t_first[rid], single.t_last[rid], single.tokens[rid])
    progress(f"engine single stream: {single.tokens[rid]} tokens, {single_tpot:.2f} ms/token")
    run = run_engine(engine, [concurrent_prompt(i) for i in range(num_streams)], max_tokens)
    tok_s = sum(run.tokens.values()) / run.elapsed_s
    progress(f"engine {num_streams} streams: {tok_s:.1f} tok/s over {run.elapsed_s:.2f} s")
    return single_tpot, single.tokens[rid], tok_s, run


# ---------------------------------------------------------------- main


def _model_name(model: str) -> str:
    from worker.models.store import resolve_model

    return resolve_model(model).name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", help="a Hugging Face folder, or 'default'")
    parser.add_argument("--num-streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per concurrent stream")
    parser.add_argument("--single-tokens", type=int, default=128, help="output tokens of the single stream")
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--mock", type=int, default=0, metavar="N", help="N mock workers (and a mock engine)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object on stdout")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_streams < 1 or args.max_tokens < 2 or args.single_tokens < 2:
        parser.error("--num-streams must be >= 1, --max-tokens and --single-tokens >= 2")
    return args


def run(args: argparse.Namespace) -> dict[str, object]:
    """Measure; the JSON object ``main`` prints."""

    load_before = os.getloadavg()[0]
    serve_args = ["--mock", str(args.mock)] if args.mock else ["--model", args.model]
    port = args.port if args.port is not None else free_port()
    progress(f"starting tierserve serve {' '.join(serve_args)} on 127.0.0.1:{port}")
    with tempfile.TemporaryDirectory(prefix="gateway-overhead-") as tmp:
        log_path = Path(tmp) / "serve.log"
        try:
            with running_server(serve_args, log_path, READY_TIMEOUT_S, port=port) as server:
                server_pid = server.process.pid
                stack_single, stack_tok_s, stack_results = asyncio.run(
                    measure_stack(server.base_url, args.single_tokens, args.num_streams, args.max_tokens)
                )
        except BaseException:
            progress(f"the server's log ends with:\n{log_tail(log_path)}")
            raise
    progress("server stopped; loading the engine in-process")

    engine = build_engine(args.model, bool(args.mock))
    engine_tpot, engine_single_tokens, engine_tok_s, engine_run = measure_engine(
        engine, args.single_tokens, args.num_streams, args.max_tokens
    )

    stack_tpot = tpot_ms(stack_single.t_first, stack_single.t_last, stack_single.num_tokens)
    result = {
        "model": "mock" if args.mock else _model_name(args.model),
        "mock_workers": args.mock,
        "threads": os.cpu_count(),
        "single_max_tokens": args.single_tokens,
        "stack_single_tokens": stack_single.num_tokens,
        "engine_single_tokens": engine_single_tokens,
        "stack_tpot_ms": round(stack_tpot, 3),
        "engine_tpot_ms": round(engine_tpot, 3),
        "overhead_ratio": round(stack_tpot / engine_tpot, 3),
        "num_streams": args.num_streams,
        "max_tokens": args.max_tokens,
        "stack_completed": sum(r.finish_reason is not None for r in stack_results),
        "engine_completed": engine_run.finished,
        "stack_tokens": sum(r.num_tokens for r in stack_results),
        "engine_tokens": sum(engine_run.tokens.values()),
        "stack_tok_s": round(stack_tok_s, 2),
        "engine_tok_s": round(engine_tok_s, 2),
        "concurrent_ratio": round(stack_tok_s / engine_tok_s, 3),
        # Other load on the machine skews both sides differently: the 1-minute load average around the run.
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "server_pid": server_pid,  # its process group is gone by now (the test checks)
    }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
