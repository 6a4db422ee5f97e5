"""What the machine gave a bench's server: the hypervisor's share of the CPU time during each repetition,
and the memory's read bandwidth around the server's run.

On a VM a neighbour shows up as ``steal`` in ``/proc/stat``: the time a vCPU was ready to run and the
host ran something else. Contention for the caches and memory does not show there; the read bandwidth
measured just before a server starts and just after it stops (nothing of the bench running) does.
A repetition far below its siblings, with steal beside it or the bandwidth down, was the machine's,
not the server's (the 2-core Zen 3 VM of 2026-12-07 spread 128-192 tok/s within minutes, its FMA rate
steady and our linears' GFLOPS not).

    cpu  user nice system idle iowait irq softirq steal guest guest_nice     (/proc/stat, jiffies)
"""

from __future__ import annotations

import statistics
import time
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


def read_gb_s(num_bytes: int = 256 * 1024**2, passes: int = 5) -> float:
    """The memory's read bandwidth now, GB/s: a sum over ``num_bytes`` of float32 (far past any cache),
    the median of ``passes`` (not the best: a neighbour's share is what this is for); one decimal."""
    import torch  # lazy: the bench's client imports it only once a model is pulled

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    src.sum()  # first touch: page faults are not bandwidth
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - start)
    return round(num_bytes / statistics.median(times) / 1e9, 1)
