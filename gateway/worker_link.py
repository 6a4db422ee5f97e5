"""Where serve's dispatcher listens for workers, with which CURVE keys, and what its own workers need.

    gateway.worker_address          tcp://127.0.0.1:0 by default: loopback, a free port
    gateway.curve_secret_key_file   ┐ both set: the ROUTER is a CURVE server (gateway/link_security.py)
    gateway.curve_authorized_keys_dir ┘

With CURVE on, the workers serve starts itself need keys the gateway accepts: a throwaway key pair,
made for this run in a private temporary folder (0700, deleted on exit) and authorized for this run
only, plus a file with the gateway's public key. Nothing is written to the configured folders.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import zmq.auth

from gateway.link_security import CurveServerKeys
from wire.config import GatewayConfig
from wire.curve import load_public_key, write_public_key

__all__ = ["WorkerLink", "is_loopback", "worker_link"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True, slots=True)
class WorkerLink:
    address: str  # what the dispatcher binds
    curve: CurveServerKeys | None
    worker_args: list[str] = field(default_factory=list)  # CURVE flags for serve's own workers

    def describe(self, bound: str) -> str:
        """One line for the start-up log; ``bound``: the address as bound (a port 0 resolved)."""
        if self.curve is None:
            return f"worker links on {bound}, plain (no CURVE)"
        return f"worker links on {bound}, CURVE ({len(self.curve.authorized_keys)} worker keys authorized)"

    @property
    def exposure_warning(self) -> str | None:
        """Why this is unsafe, when it is: a plain link anyone on the network can reach."""
        if self.curve is not None or is_loopback(self.address):
            return None
        return (
            f"gateway.worker_address {self.address} is reachable from other hosts without CURVE: "
            "anyone who can reach it can register as a worker and read the prompts sent to it "
            "(see 'Securing worker links' in docs/operations.md)"
        )


def is_loopback(address: str) -> bool:
    """ipc:// stays on this host; tcp:// does when its host is a loopback name."""
    if address.startswith("ipc://"):
        return True
    host = address.removeprefix("tcp://").rpartition(":")[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


@contextlib.contextmanager
def worker_link(config: GatewayConfig, *, own_workers: bool) -> Iterator[WorkerLink]:
    """The link as configured; with CURVE and ``own_workers``, the throwaway keys live until exit."""
    keys = CurveServerKeys.from_config(config)
    if keys is None or not own_workers:
        yield WorkerLink(config.worker_address, keys)
        return
    with tempfile.TemporaryDirectory(prefix="tierserve-worker-keys-") as folder:
        public_file, secret_file = zmq.auth.create_certificates(folder, "serve-workers")
        server_file = Path(folder) / "gateway.key"
        write_public_key(server_file, keys.key_pair.public_key)
        args = ["--curve-secret-key-file", str(secret_file), "--curve-server-key-file", str(server_file)]
        yield WorkerLink(config.worker_address, keys.authorizing(load_public_key(public_file)), args)
