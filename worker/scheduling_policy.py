"""The scheduler's policy hooks: who waits first, who is preempted.

The scheduler holds no ordering logic of its own; the policies issue replaces these defaults
with plugins. A policy sees requests and returns choices; it never mutates them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from worker.request import Request


class SchedulingPolicy(Protocol):
    def order_waiting(self, waiting: Sequence[Request]) -> list[Request]:
        """The order in which waiting requests are considered for admission this step."""
        ...

    def choose_victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when the KV cache is full (``running`` is non-empty)."""
        ...


class FcfsPolicy:
    """First come, first served; the newest arrival is preempted first."""

    def order_waiting(self, waiting: Sequence[Request]) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival_time)

    def choose_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: r.arrival_time)
