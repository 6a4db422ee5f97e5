"""CURVE on the worker links, with real processes and keys made by ``tierserve keys generate``.

    gateway: serve --mock 1 --no-workers, CURVE (its key pair; authorized/ holds worker.key only)
    worker "trusted":   the authorized key pair and the gateway's public key   → ready, serves
    worker "stranger":  a key pair the gateway does not list                  → refused, logged
    worker "plain":     no keys at all                                        → refused, logged

And ``serve`` with CURVE starting its own workers (a throwaway key pair it authorizes), and the config
mistakes that must stop start-up with a message naming the key.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from loadtest.failover_bench import metric, scrape
from loadtest.launch import ROOT, Server, free_port, log_tail, running_server
from wire.curve import load_public_key
from worker.mock import MockModel, MockTokenizer

pytestmark = pytest.mark.timeout(180)

START_TIMEOUT_S = 90.0
TIMEOUT_S = 30.0
TOKENIZER = MockTokenizer()
MODEL = MockModel()


@dataclass(frozen=True)
class Keys:
    folder: Path

    def secret(self, name: str) -> Path:
        return self.folder / name / f"{name}.key_secret"

    def public(self, name: str) -> Path:
        return self.folder / name / f"{name}.key"

    @property
    def authorized(self) -> Path:
        return self.folder / "authorized"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    keys = Keys(tmp_path_factory.mktemp("keys"))
    for name in ("gateway", "worker", "stranger"):
        done = tierserve("keys", "generate", str(keys.folder / name))
        assert done.returncode == 0, done.stderr
        assert keys.secret(name).stat().st_mode & 0o077 == 0  # the secret is private
    keys.authorized.mkdir()
    shutil.copy(keys.public("worker"), keys.authorized)  # only the worker's public key goes over
    again = tierserve("keys", "generate", str(keys.folder / "gateway"))
    assert again.returncode == 2 and "will not overwrite" in again.stderr
    return keys


def tierserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierserve", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def curve_config(tmp: Path, keys: Keys, address: str = "tcp://127.0.0.1:0") -> Path:
    path = tmp / "tierserve.toml"
    path.write_text(
        f'[gateway]\nworker_address = "{address}"\ncurve_secret_key_file = "{keys.secret("gateway")}"\n'
        f'curve_authorized_keys_dir = "{keys.authorized}"\n'
    )
    return path


@contextlib.contextmanager
def worker(tmp: Path, worker_id: str, address: str, *curve: str) -> Iterator[subprocess.Popen[bytes]]:
    with (tmp / f"{worker_id}.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "worker", "--mock", "--worker-id", worker_id,
             "--connect", address, *curve],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )  # fmt: skip
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def wait_for_log(path: Path, *texts: str) -> None:
    """Until the log at ``path`` says one of ``texts``."""
    deadline = time.monotonic() + TIMEOUT_S
    while not any(text in path.read_text(errors="replace") for text in texts):
        assert time.monotonic() < deadline, f"{path.name} never said {texts!r}:\n{log_tail(path)}"
        time.sleep(0.05)  # the poll interval of a deadline-bounded wait


def complete(server: Server, prompt: str, max_tokens: int = 24) -> None:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", timeout=30, max_retries=0
    ) as client:
        answer = client.completions.create(model="mock", prompt=prompt, max_tokens=max_tokens, temperature=0)
    want = TOKENIZER.decode(MODEL.transcript(TOKENIZER.encode(prompt), max_tokens), skip_special_tokens=True)
    assert answer.choices[0].text == want


def test_only_the_worker_with_an_authorized_key_serves(tmp_path: Path, keys: Keys) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    config = curve_config(tmp_path, keys, address)
    gateway_log = tmp_path / "gateway.log"
    trusted = ("--curve-secret-key-file", str(keys.secret("worker")))
    stranger = ("--curve-secret-key-file", str(keys.secret("stranger")))
    server_key = ("--curve-server-key-file", str(keys.public("gateway")))
    with (
        worker(tmp_path, "trusted", address, *trusted, *server_key) as trusted_worker,
        worker(tmp_path, "stranger", address, *stranger, *server_key) as stranger_worker,
        worker(tmp_path, "plain", address) as plain_worker,
        running_server(
            ["--mock", "1", "--no-workers", "--config", str(config)], gateway_log, START_TIMEOUT_S
        ) as server,
    ):
        complete(server, "a request over an encrypted link")
        stranger_key = load_public_key(keys.public("stranger")).decode()
        wait_for_log(gateway_log, f"refused a worker link: CURVE public key {stranger_key}")
        # the plain worker (which of the two depends on which end hangs up first)
        wait_for_log(gateway_log, "handshake (mechanism mismatch", "handshake (no detail: the worker hung up")
        wait_for_log(tmp_path / "stranger.log", "the gateway refused this worker's CURVE key")
        text = scrape(server.base_url)
        assert metric(text, "tierserve_worker_up", worker="trusted", state="ready") == 1
        for refused in ("stranger", "plain"):  # never registered: not even listed
            assert f'worker="{refused}"' not in text
        assert "CURVE (1 worker keys authorized)" in gateway_log.read_text()
        assert [p.poll() for p in (trusted_worker, stranger_worker, plain_worker)] == [None] * 3


def test_serve_with_curve_starts_workers_it_lets_in(tmp_path: Path, keys: Keys) -> None:
    log = tmp_path / "serve.log"
    with running_server(
        ["--mock", "1", "--config", str(curve_config(tmp_path, keys))], log, START_TIMEOUT_S
    ) as server:
        complete(server, "its own workers hold a throwaway key")
        assert "CURVE (2 worker keys authorized)" in log.read_text()  # the configured one + its own


@pytest.mark.parametrize(
    ("gateway", "args", "error"),
    [
        (
            'curve_secret_key_file = "{tmp}/missing.key_secret"\ncurve_authorized_keys_dir = "{authorized}"',
            [],
            "config error at gateway.curve_secret_key_file: {tmp}/missing.key_secret: no such file",
        ),
        (
            'curve_secret_key_file = "{secret}"',
            [],
            "config error at gateway.curve_authorized_keys_dir: CURVE needs it too",
        ),
        ("", ["--no-workers"], "serve --no-workers needs a fixed gateway.worker_address"),
    ],
)
def test_start_up_mistakes_are_clear(
    tmp_path: Path, keys: Keys, gateway: str, args: list[str], error: str
) -> None:
    values = {"tmp": tmp_path, "authorized": keys.authorized, "secret": keys.secret("gateway")}
    config = tmp_path / "tierserve.toml"
    config.write_text("[gateway]\n" + gateway.format(**values) + "\n")
    done = tierserve("serve", "--mock", "1", "--config", str(config), *args)
    assert done.returncode == 2
    assert error.format(**values) in done.stderr
