"""The worker's liveness file: its modification time says when the daemon's loop last made progress.

    daemon loop ──beat()──▶ touch PATH (at most once a second)
    tierserve worker probe --liveness-file PATH --max-age-s S  ──▶ exit 0 if touched within S seconds

The loop beats after every finished engine step and every idle wait (at most ``IDLE_WAIT_S``), so an
idle healthy worker stays fresh and an engine stuck inside a step goes stale: the heartbeat thread
cannot touch it, which is the point (a hung engine keeps heartbeating, see gateway/workers.py). A
Kubernetes exec probe runs the check (deploy/, docs/deploy.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

MIN_BEAT_INTERVAL_S = 1.0  # a busy loop steps every few ms: one syscall a second is plenty


class Liveness(Protocol):
    def beat(self) -> None:
        """The loop made progress (a step finished, or it waited idle and is about to look again)."""


class NullLiveness:
    """No liveness file (the default): the loop beats into nothing, never asking whether one is set."""

    def beat(self) -> None:
        pass


NULL_LIVENESS = NullLiveness()


class LivenessFile:
    """Touches ``path`` on ``beat`` at most once per ``min_interval_s``.

    Created afresh: a file left by an earlier run (an emptyDir outlives a container restart) is removed,
    so a restarted worker counts as alive only once its own loop has run. A failed touch is logged once
    and never stops the worker; the probe then reports the file stale, which is the truth."""

    def __init__(
        self,
        path: str | Path,
        *,
        min_interval_s: float = MIN_BEAT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last_beat: float | None = None
        self._has_failed = False
        self.path.unlink(missing_ok=True)

    def beat(self) -> None:
        now = self._clock()
        if self._last_beat is not None and now - self._last_beat < self.min_interval_s:
            return
        self._last_beat = now
        try:
            self.path.touch()  # creates it, or sets its mtime to now
        except OSError as exc:
            if not self._has_failed:
                log.warning("cannot touch the liveness file %s: %s", self.path, exc)
                self._has_failed = True


def check(path: str | Path, max_age_s: float, now: float | None = None) -> str | None:
    """None when ``path`` was touched within ``max_age_s`` seconds (wall clock), else why not."""
    now = time.time() if now is None else now
    try:
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        return f"no liveness file at {path}: the worker's loop has not started (still loading?)"
    except OSError as exc:
        return f"cannot read the liveness file {path}: {exc}"
    age = now - mtime
    if age > max_age_s:
        return (
            f"no progress for {age:.1f} s (more than {max_age_s:g} s): the engine is stuck in a step, "
            "or the process is stopped"
        )
    return None
