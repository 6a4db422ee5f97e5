"""Hosts on one machine: Linux network namespaces joined by a bridge of their own (``ip netns``, root).

    ┌ <prefix>-sw ─────────────────────────┐     one "switch" namespace holds the bridge; every host
    │  br0 ── gw ── w1 ── w2   (veth ends)  │     is a namespace with one veth, eth0, whose other end
    └────────┼─────┼─────┼──────────────────┘     is a port of br0. Nothing is created in the caller's
       eth0 10.99.0.1  .11   .12               namespace: no host interface carries any of the traffic.
       <prefix>-gw  -w1   -w2

The names carry the caller's pid (``tsmh-<pid>-…``), so parallel runs never clash; a run that died
without tearing down (SIGKILL) leaves namespaces whose pid is gone, and the next :func:`sweep_stale`
removes them, with what still runs in them. The same addresses in every run are fine: each run's
segment is its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

PREFIX = "tsmh"
SUBNET = "10.99.0.{}/24"
HOST_INTERFACE = "eth0"
BRIDGE = "br0"
_OWNED = re.compile(rf"^{PREFIX}-(\d+)-\w+$")


class NetnsError(RuntimeError):
    """An ``ip`` command failed (not root, no netns support, a name taken)."""


def ip(*args: str) -> str:
    """``ip ARGS``; its stdout, or :class:`NetnsError` with its stderr."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def why_not_permitted() -> str | None:
    """None where this process may create network namespaces; else why not, in a sentence."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except (NetnsError, OSError) as exc:
        return f"cannot create a network namespace: {exc}"
    with suppress(NetnsError):
        ip("netns", "del", probe)
    return None


def sweep_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone, killing what still runs in them."""
    removed = []
    for name in namespaces():
        match = _OWNED.match(name)
        if match is None or _is_alive(int(match.group(1))):
            continue
        _kill_all_in(name)
        with suppress(NetnsError):
            ip("netns", "del", name)
            removed.append(name)
    return removed


@dataclass(frozen=True, slots=True)
class Host:
    name: str  # its role: "gw", "w1", ...
    netns: str
    address: str  # on its eth0, without the prefix length

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass(slots=True)
class Topology:
    switch: str
    hosts: dict[str, Host] = field(default_factory=dict)

    def link_down(self, host: str) -> None:
        """The host loses its link: its eth0 goes down (the kernel drops its routes with it)."""
        ip("-n", self.hosts[host].netns, "link", "set", HOST_INTERFACE, "down")

    def link_up(self, host: str) -> None:
        ip("-n", self.hosts[host].netns, "link", "set", HOST_INTERFACE, "up")


@contextmanager
def topology(host_names: Sequence[str]) -> Iterator[Topology]:
    """The switch and one namespace per host (addresses 10.99.0.1, then .11, .12, …), all deleted on
    the way out whatever happened; what still runs in them is killed first."""
    tag = f"{PREFIX}-{os.getpid()}"
    net = Topology(switch=f"{tag}-sw")
    created: list[str] = []
    try:
        ip("netns", "add", net.switch)
        created.append(net.switch)
        ip("-n", net.switch, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", net.switch, "link", "set", BRIDGE, "up")
        for i, name in enumerate(host_names):
            host = Host(name, f"{tag}-{name}", SUBNET.format(1 if i == 0 else 10 + i).split("/")[0])
            ip("netns", "add", host.netns)
            created.append(host.netns)
            # Both ends are made inside namespaces: the switch's port is named after the host.
            ip("-n", net.switch, "link", "add", name, "type", "veth", "peer", "name", HOST_INTERFACE,
               "netns", host.netns)  # fmt: skip
            ip("-n", net.switch, "link", "set", name, "master", BRIDGE, "up")
            ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", HOST_INTERFACE)
            ip("-n", host.netns, "link", "set", HOST_INTERFACE, "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
            net.hosts[name] = host
        yield net
    finally:
        for name in reversed(created):
            _kill_all_in(name)
            with suppress(NetnsError):
                ip("netns", "del", name)  # its veth ends go with it


def _kill_all_in(netns: str) -> None:
    with suppress(NetnsError):
        for pid in ip("netns", "pids", netns).split():
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
