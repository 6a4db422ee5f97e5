"""The live progress line on stderr: one line rewritten in place on a terminal, a line every few
seconds otherwise (logs and pipes)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from loadtest.records import RequestRecord

TTY_INTERVAL_S = 0.5
LOG_INTERVAL_S = 5.0


@dataclass(slots=True)
class Progress:
    total: int | None  # requests per target, when the count bounds the run
    duration_s: float | None
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    num_sent: int = 0
    num_done: int = 0
    num_failed: int = 0
    num_output_tokens: int = 0
    _started: float = field(default_factory=time.perf_counter)
    _last_shown: float = 0.0

    @property
    def interval_s(self) -> float:
        return TTY_INTERVAL_S if self.stream.isatty() else LOG_INTERVAL_S

    def on_sent(self) -> None:
        self.num_sent += 1

    def on_done(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_failed += not record.is_ok
        self.num_output_tokens += record.num_output_tokens or 0

    def line(self) -> str:
        elapsed = time.perf_counter() - self._started
        of = f"/{self.total}" if self.total is not None else ""
        bound = f"/{self.duration_s:g}" if self.duration_s is not None else ""
        tok_s = self.num_output_tokens / elapsed if elapsed > 0 else 0.0
        return (
            f"[load] {elapsed:5.1f}{bound} s  sent {self.num_sent}{of}  done {self.num_done}  "
            f"in flight {self.num_sent - self.num_done}  failed {self.num_failed}  "
            f"{self.num_output_tokens} tok ({tok_s:.0f} tok/s)"
        )

    def show(self, final: bool = False) -> None:
        if self.stream.isatty():
            self.stream.write("\r\x1b[2K" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
        self._last_shown = time.perf_counter()
