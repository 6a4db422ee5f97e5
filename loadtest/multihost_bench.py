"""The ``multihost`` scenario: a gateway and two workers on three "hosts" (network namespaces), joined
over TCP with CURVE; one worker's host loses its link mid-stream, then gets it back.

    tierserve bench multihost --json [--streams 16] [--max-tokens 300] [--down-s 6] [--real]

Needs root (``ip netns``). The hosts are namespaces on a bridge of their own (``loadtest/netns.py``):
``gw`` 10.99.0.1 runs ``tierserve serve --no-workers`` (CURVE: keys made by ``tierserve keys generate``
for the run), ``w1`` and ``w2`` each run ``tierserve worker --connect tcp://10.99.0.1:5555`` (mock:
``--mock-step-ms`` a step, one token of every stream; ``--real``: the embedded model in float32, so a
migrated stream resumes exactly). The client (``loadtest/netns_client.py``) runs inside ``gw``'s
namespace and opens ``--streams`` greedy streams; once each has ``--cut-after-chunks`` chunks, ``w1``'s
eth0 goes down (``ip link set eth0 down``) for ``--down-s`` seconds, longer than ZeroMQ's own 5 s
heartbeat, so the old TCP link is given up on both sides and the worker must dial and register again.
Then a second wave of ``--streams`` streams of ``--wave2-tokens`` shows the readmitted worker serving
again. Figures:

- ``hosts``: namespaces running a part of the fleet (gateway + workers);
- ``requests``, ``tokens``: streams of both waves, and the completion tokens they received;
- ``lost_requests``: streams that did not end normally with all their tokens; ``duplicated_tokens``:
  bytes beyond the no-failure transcript (the same prompt asked again, unstreamed, after the run; the
  mock's tokens are bytes); ``mismatched_streams``: texts that are not exactly that transcript;
- ``affected_streams``: first-wave streams placed on ``w1`` (``x-tierserve-worker``) still running at
  the cut; ``migrated``: requests the gateway moved (``tierserve_migrations_total``);
- ``detect_s``: link down → ``/metrics`` shows ``w1`` dead (``tierserve_worker_up{state="dead"}``);
- ``recovery_s``: link down → the last affected stream's first chunk from its new worker (the end of
  its longest silence after the cut): every stream that lost its worker producing tokens again;
- ``readmit_s``: link up → ``/metrics`` shows ``w1`` ready again; ``registrations_w1``: the Registers
  ``w1`` sent (its ``--log-file``: one per new link, so 2 when the outage outlived the old link);
  ``served_after_readmit``: second-wave streams the gateway placed on ``w1``;
- ``max_stall_ms``: the longest gap between two chunks of any stream; ``switch_bytes``: bytes the
  bridge's ports carried (the workers' traffic, which crossed nothing else).

Everything (processes, then namespaces) is torn down on the way out, on failure, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from loadtest import netns
from loadtest.failover_bench import StreamResult, metric, wait_for
from loadtest.launch import ROOT, log_tail

HOSTS = ("gw", "w1", "w2")
VICTIM = "w1"
HTTP_PORT = 8000
WORKER_PORT = 5555
REAL_MODEL = "smollm2-135m-instruct"
READY_TIMEOUT_S = 180.0
STEP_TIMEOUT_S = 60.0  # any one wait of the scenario after the fleet is up
STOP_TIMEOUT_S = 10.0


def progress(message: str) -> None:
    print(f"[multihost] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierserve bench multihost", description=__doc__)
    parser.add_argument("--real", action="store_true", help="workers run the embedded model, float32")
    parser.add_argument("--streams", type=int, default=None, help="per wave (mock 16, real 4)")
    parser.add_argument("--max-tokens", type=int, default=None, help="first wave (mock 300, real 64)")
    parser.add_argument("--wave2-tokens", type=int, default=None, help="second wave (mock 40, real 16)")
    parser.add_argument("--cut-after-chunks", type=int, default=None, help="(mock 20, real 4)")
    parser.add_argument("--down-s", type=float, default=6.0, help="how long w1's link stays down")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=1.5, help="gateway.heartbeat_timeout_s")
    parser.add_argument("--mock-step-ms", type=float, default=20.0, help="mock: time per step")
    parser.add_argument("--kv-cache-gb", type=float, default=0.032, help="real: KV cache per worker, GiB")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep each process's log here")
    args = parser.parse_args(argv)
    for name, mock, real in (
        ("streams", 16, 4),
        ("max_tokens", 300, 64),
        ("wave2_tokens", 40, 16),
        ("cut_after_chunks", 20, 4),
    ):
        if getattr(args, name) is None:
            setattr(args, name, real if args.real else mock)
    return args


def run(args: argparse.Namespace) -> dict[str, object]:
    reason = netns.why_not_permitted()
    if reason is not None:
        raise SystemExit(f"[multihost] {reason}")
    for name in netns.sweep_stale():
        progress(f"removed {name}, left by an earlier run")
    model = REAL_MODEL if args.real else "mock"
    with tempfile.TemporaryDirectory(prefix="multihost-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        log_dir = args.log_dir or tmp
        log_dir.mkdir(parents=True, exist_ok=True)
        logs = {name: log_dir / f"{name}.log" for name in (*HOSTS, "client", "w1-info", "w2-info")}
        try:
            progress(f"namespaces {', '.join(HOSTS)} on a bridge of their own")
            net = stack.enter_context(netns.topology(HOSTS))
            client = _start_fleet(args, stack, net, tmp, logs, model)
            progress(f"gateway and 2 {model} workers starting")
            wait_for(lambda: _num_ready(client, model) == 2, READY_TIMEOUT_S, "both workers ready")
            figures = _scenario(args, net, client, model)
        except Exception:  # (not Ctrl-C, SIGTERM: asked for)
            for name, path in logs.items():
                progress(f"{name}'s log ends with:\n{log_tail(path)}")
            raise
        gateway_log = logs["gw"].read_text(errors="replace")
        figures["curve"] = "CURVE (2 worker keys authorized)" in gateway_log
        # The worker's INFO log: "worker w1 connected to ...; sending Register" once per new link.
        figures["registrations_w1"] = logs[f"{VICTIM}-info"].read_text().count("sending Register")
        figures["switch_bytes"] = _switch_bytes(net)
        progress("tearing down")
        return figures


def _start_fleet(
    args: argparse.Namespace,
    stack: ExitStack,
    net: netns.Topology,
    tmp: Path,
    logs: dict[str, Path],
    model: str,
) -> _Client:
    """The gateway in ``gw``, a worker in each other host, and the client in ``gw``: each stopped by
    ``stack`` (before the namespaces go)."""
    gw = net.hosts["gw"]
    gateway_address = f"tcp://{gw.address}:{WORKER_PORT}"
    keys = _make_keys(tmp)
    config = tmp / "tierserve.toml"
    config.write_text(_gateway_config(args, gateway_address, keys))
    serve = [sys.executable, "-m", "tierserve", "serve", "--host", gw.address, "--port", str(HTTP_PORT),
             "--no-workers", "--config", str(config), *(() if args.real else ("--mock", "1"))]  # fmt: skip
    stack.enter_context(_process(gw.command(serve), logs["gw"]))
    for name in HOSTS[1:]:
        worker = [sys.executable, "-m", "worker.cli", "worker", "--connect", gateway_address,
                  "--worker-id", name, "--curve-secret-key-file", str(keys / name / f"{name}.key_secret"),
                  "--curve-server-key-file", str(keys / "gateway" / "gateway.key"),
                  "--log-file", str(logs[f"{name}-info"]), *_engine_args(args)]  # fmt: skip
        stack.enter_context(_process(net.hosts[name].command(worker), logs[name]))
    base_url = f"http://{gw.address}:{HTTP_PORT}"
    return stack.enter_context(_client(gw, base_url, model, logs["client"]))


def _scenario(
    args: argparse.Namespace, net: netns.Topology, client: _Client, model: str
) -> dict[str, object]:
    prompts = [f"multihost stream {i}" for i in range(args.streams)]
    client.start(prompts, args.max_tokens)
    wait_for(
        lambda: min(client.num_chunks()) >= args.cut_after_chunks,
        STEP_TIMEOUT_S,
        f"every stream past {args.cut_after_chunks} chunks",
    )
    progress(f"{args.streams} streams flowing; {VICTIM}'s link goes down")
    cut_at = time.monotonic()
    net.link_down(VICTIM)
    detect_s = wait_for(lambda: _state(client, VICTIM) == "dead", STEP_TIMEOUT_S, f"{VICTIM} seen dead")
    progress(f"the gateway saw {VICTIM} dead after {detect_s:.2f} s")
    time.sleep(max(0.0, cut_at + args.down_s - time.monotonic()))  # the outage is the parameter
    up_at = time.monotonic()
    net.link_up(VICTIM)
    readmit_s = wait_for(lambda: _state(client, VICTIM) == "ready", STEP_TIMEOUT_S, f"{VICTIM} readmitted")
    progress(f"{VICTIM}'s link up after {up_at - cut_at:.1f} s; readmitted {readmit_s:.2f} s later")
    first = client.finish()
    second_prompts = [f"multihost after readmission {i}" for i in range(args.streams)]
    client.start(second_prompts, args.wave2_tokens)
    second = client.finish()[len(first) :]
    progress("both waves done; asking each prompt again for its no-failure transcript")
    references = [
        *client.reference(prompts, args.max_tokens),
        *client.reference(second_prompts, args.wave2_tokens),
    ]
    text = client.metrics()
    streams = [*first, *second]
    affected = [r for r in first if r.worker == VICTIM and r.chunk_times and r.chunk_times[-1] > cut_at]
    recovery = max((_resumed_at(r, cut_at) - cut_at for r in affected), default=0.0)
    lost = [r for r in streams if not r.is_complete]
    for r in lost[:3]:
        progress(f"lost: {r.prompt!r}: {r.error or r.finish_reason}")
    pairs = list(zip(streams, references, strict=True))
    return {
        "scenario": "multihost-real" if args.real else "multihost",  # --record's block
        "model": model,
        "hosts": len(HOSTS),
        "requests": len(streams),
        "tokens": sum(r.completion_tokens or 0 for r in streams),
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "heartbeat_timeout_s": args.heartbeat_timeout_s,
        "down_s": round(up_at - cut_at, 2),
        "lost_requests": len(lost),
        "duplicated_tokens": sum(max(0, len(r.text.encode()) - len(ref.encode())) for r, ref in pairs),
        "mismatched_streams": sum(r.text != ref for r, ref in pairs),
        "affected_streams": len(affected),
        "migrated": int(metric(text, "tierserve_migrations_total", model=model)),
        "workers_lost": int(metric(text, "tierserve_workers_lost_total")),
        "detect_s": round(detect_s, 3),
        "recovery_s": round(recovery, 3),
        "readmit_s": round(readmit_s, 3),
        "served_after_readmit": sum(r.worker == VICTIM for r in second),
        "max_stall_ms": round(max(r.max_gap_s() for r in streams) * 1e3, 1),
    }


# ------------------------------------------------------------------------------ the fleet's parts


def _make_keys(tmp: Path) -> Path:
    """``tierserve keys generate`` for the gateway and each worker; authorized/ gets the workers' .key."""
    keys = tmp / "keys"
    (keys / "authorized").mkdir(parents=True)
    for name in HOSTS:
        folder = keys / ("gateway" if name == "gw" else name)
        command = [sys.executable, "-m", "tierserve", "keys", "generate", str(folder)]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=60)
        if name != "gw":
            (keys / "authorized" / f"{name}.key").write_bytes((folder / f"{name}.key").read_bytes())
    return keys


def _gateway_config(args: argparse.Namespace, address: str, keys: Path) -> str:
    text = (
        f'[gateway]\nworker_address = "{address}"\n'
        f'curve_secret_key_file = "{keys / "gateway" / "gateway.key_secret"}"\n'
        f'curve_authorized_keys_dir = "{keys / "authorized"}"\n'
        f"heartbeat_timeout_s = {args.heartbeat_timeout_s}\n"
        f"hang_timeout_s = {max(30.0, args.heartbeat_timeout_s)}\ndrain_timeout_s = 5.0\n"
    )
    if args.real:
        text += f'\n[[models.pools]]\nname = "{REAL_MODEL}"\npath = "default"\ndtype = "float32"\n'
    return text


def _engine_args(args: argparse.Namespace) -> list[str]:
    if not args.real:
        return ["--mock", "--mock-step-ms", str(args.mock_step_ms), "--served-name", "mock"]
    return ["--model", "default", "--dtype", "float32", "--served-name", REAL_MODEL,
            "--kv-cache-gb", str(args.kv_cache_gb), "--num-threads", "1", "--no-calibrate"]  # fmt: skip


@contextmanager
def _process(command: Sequence[str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process in its own session, logging to ``log_path``; SIGTERM, then SIGKILL, on the way out."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield process
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    if process.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT_S)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_TIMEOUT_S)


@dataclass(slots=True)
class _Client:
    """The bench's end of ``loadtest/netns_client.py``, running in the gateway's namespace."""

    process: subprocess.Popen[str]
    model: str

    def metrics(self) -> str:
        return str(self._call(op="metrics")["text"])

    def start(self, prompts: list[str], max_tokens: int) -> None:
        self._call(op="start", prompts=prompts, max_tokens=max_tokens, model=self.model)

    def num_chunks(self) -> list[int]:
        streams = self._call(op="progress")["streams"]
        assert isinstance(streams, list)
        return [int(s["num_chunks"]) for s in streams]

    def finish(self) -> list[StreamResult]:
        streams = self._call(op="finish")["streams"]
        assert isinstance(streams, list)
        return [StreamResult(**s) for s in streams]

    def reference(self, prompts: list[str], max_tokens: int) -> list[str]:
        texts = self._call(op="reference", prompts=prompts, max_tokens=max_tokens, model=self.model)["texts"]
        assert isinstance(texts, list)
        return [str(t) for t in texts]

    def _call(self, **command: object) -> dict[str, object]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise ClientExited(f"the namespaced client exited ({self.process.poll()})")
        answer: dict[str, object] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the namespaced client, {command['op']}: {answer['error']}")
        return answer


class ClientExited(RuntimeError):
    pass


@contextmanager
def _client(host: netns.Host, base_url: str, model: str, log_path: Path) -> Iterator[_Client]:
    command = host.command([sys.executable, "-m", "loadtest.netns_client", base_url])
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            start_new_session=True,
        )  # fmt: skip
    try:
        yield _Client(process, model)
    finally:
        assert process.stdin is not None
        with suppress(OSError):
            process.stdin.close()  # EOF: it exits
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT_S)
        _stop(process)


# ---------------------------------------------------------------------------------- observations


def _metrics(client: _Client) -> str:
    """The gateway's /metrics, or "" while it does not answer yet."""
    try:
        return client.metrics()
    except ClientExited:
        raise
    except RuntimeError:
        return ""


def _num_ready(client: _Client, model: str) -> int:
    return int(metric(_metrics(client), "tierserve_worker_up", model=model, state="ready"))


def _state(client: _Client, worker: str) -> str | None:
    text = _metrics(client)
    states = ("ready", "draining", "dead")
    return next((s for s in states if metric(text, "tierserve_worker_up", worker=worker, state=s)), None)


def _resumed_at(result: StreamResult, cut_at: float) -> float:
    """When a stream that lost its worker at ``cut_at`` had tokens again: the end of its longest
    silence ending after the cut (chunks the old worker had already sent may still land just after it)."""
    gaps = [(b - a, b) for a, b in itertools.pairwise(result.chunk_times) if b > cut_at]
    return max(gaps)[1] if gaps else result.chunk_times[-1]


def _switch_bytes(net: netns.Topology) -> int:
    links = json.loads(netns.ip("-n", net.switch, "-j", "-s", "link", "show", "master", netns.BRIDGE))
    return sum(int(link["stats64"]["rx"]["bytes"]) + int(link["stats64"]["tx"]["bytes"]) for link in links)
