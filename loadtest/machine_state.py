"""What the machine gave a bench's server: the hypervisor's share of the CPU time during each repetition,
and the memory's read bandwidth around the server's run.

On a VM a neighbour shows up as ``steal`` in ``/proc/stat``: the time a vCPU was ready to run and the
host ran something else. Contention for the caches and memory does not show there; the read bandwidth
measured just before a server starts and just after it stops (nothing of the bench running) does.
A repetition far below its siblings, with steal beside it or the bandwidth down, was the machine's,
not the server's (the 2-core Zen 3 VM of 2026-12-07 spread 128-192 tok/s within minutes, its FMA rate
steady and our linears' GFLOPS not).

    cpu  user nice system idle iowait irq softirq steal guest guest_nice     (/proc/stat, jiffies)

The bandwidth's timing (``pass_time``) is also the engine bench's, whose roofline takes the best pass.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
_STEAL = 7  # the eighth field after "cpu"
_COUNTED = 8  # user .. steal: guest time is counted in user already


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """The whole machine's CPU time so far (every CPU), in jiffies."""

    total: int
    steal: int


def cpu_times(path: Path = PROC_STAT) -> CpuTimes | None:
    """Now's totals; None where there is no ``/proc/stat`` (or no steal field in it: an old kernel)."""
    try:
        with path.open() as stat:
            first = stat.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 1 + _COUNTED:
        return None
    fields = [int(value) for value in first[1 : 1 + _COUNTED]]
    return CpuTimes(sum(fields), fields[_STEAL])


def steal_pct(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """The hypervisor's share of the CPU time between two readings, in percent (one decimal); None
    when either is missing or no time passed."""
    if before is None or after is None or after.total <= before.total:
        return None
    return round(100 * (after.steal - before.steal) / (after.total - before.total), 1)


Statistic = Callable[[list[float]], float]


def read_gb_s(
    num_bytes: int = 256 * 1024**2, passes: int = 5, statistic: Statistic = statistics.median
) -> float:
    """The memory's read bandwidth now, GB/s: a sum over ``num_bytes`` of float32 (far past any cache),
    timed ``passes`` times; the median by default (a neighbour's share is what the bench reads it for),
    ``min`` for what the machine can do (engine_bench's roofline)."""
    import torch  # lazy: the bench's client imports it only once a model is pulled

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / pass_time(src.sum, passes, statistic) / 1e9


def pass_time(fn: Callable[[], object], passes: int, statistic: Statistic = min) -> float:
    """``statistic`` of ``passes`` timings of ``fn``, after one untimed call (first touch: page faults
    are not bandwidth), s."""
    fn()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistic(times)
