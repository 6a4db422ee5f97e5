"""How many workers a pool runs and which GPUs each one gets: one worker per GPU by default, or one
per ``tensor_parallel_size`` GPUs.

    pool device   GPUs serve sees   num_workers "auto"        worker i's environment
    cpu           any               1                         (nothing added)
    auto          0                 1                         (nothing added)
    auto / cuda   N > 0             len(devices) or N,        CUDA_VISIBLE_DEVICES=<its GPUs>
                                    divided by the TP size
    cuda          0                 an error: no GPU to run on

A worker of ``tensor_parallel_size = T`` gets T consecutive GPUs of ``devices`` (all GPUs when empty);
GPUs left over by ``auto`` (5 GPUs, T = 2) are named in ``WorkerPlan.idle_gpus`` for serve to log. An
explicit ``num_workers`` on GPUs takes the chosen GPUs round robin, T at a time: more workers than GPUs
share them, which needs ``kv_cache_gb`` (the device-sized KV cache counts the whole GPU,
worker/kv_budget.py). ``devices`` are indices among the GPUs serve sees; when serve itself runs under
``CUDA_VISIBLE_DEVICES``, worker i gets that list's entries, so the same physical GPUs are meant. The
GPU count is passed in: this module never asks torch (tierserve/cli.py does, through worker/devices.py).
On a CPU box a TP worker's ranks are processes of that worker (worker/tp_ranks.py): nothing to place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from wire.config import ModelPool

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    num_workers: int
    worker_envs: tuple[dict[str, str], ...] = ()  # one per worker, or none
    idle_gpus: tuple[str, ...] = ()  # chosen GPUs no worker got (fewer than a TP group left over)


def uses_gpus(pool: ModelPool) -> bool:
    """Whether serve must count GPUs to plan this pool."""
    return pool.device != "cpu"


def gpu_ids(num_gpus: int, environ: Mapping[str, str]) -> list[str]:
    """What ``CUDA_VISIBLE_DEVICES`` names each of serve's ``num_gpus`` GPUs: serve's own list's entries
    (indices, UUIDs or MIG ids) when it is set, else 0..N-1."""
    given = environ.get(CUDA_VISIBLE_DEVICES)
    if given is None:
        return [str(i) for i in range(num_gpus)]
    return [entry.strip() for entry in given.split(",") if entry.strip()][:num_gpus]


def plan_workers(pool: ModelPool, key: str, num_gpus: int | None, environ: Mapping[str, str]) -> WorkerPlan:
    """The workers serve starts for ``pool`` (called ``key`` in errors). ``num_gpus`` None: the GPUs
    are not this machine's to count (workers started elsewhere), so ``auto`` is ``len(devices)`` or 1.
    ``ValueError`` naming the key for a GPU pool with no GPU, or a device index serve cannot see."""
    if num_gpus is None or not uses_gpus(pool):
        return WorkerPlan((len(pool.devices) or 1) if pool.num_workers == "auto" else pool.num_workers)
    if num_gpus == 0:
        if pool.device == "cuda" or pool.devices:
            asked = f"devices = {list(pool.devices)}" if pool.devices else 'device = "cuda"'
            raise ValueError(f"{key}: {asked}, but serve sees no CUDA device")
        return WorkerPlan(1 if pool.num_workers == "auto" else pool.num_workers)
    for index in pool.devices:
        if index >= num_gpus:
            why = f"GPU {index} is not visible (serve sees {num_gpus}: 0..{num_gpus - 1})"
            raise ValueError(f"{key}.devices: {why}")
    chosen = list(pool.devices) or list(range(num_gpus))
    size = pool.tensor_parallel_size
    if size > len(chosen):
        have = f"devices = {list(pool.devices)}" if pool.devices else f"serve sees {num_gpus}"
        raise ValueError(f"{key}.tensor_parallel_size: {size} GPUs per worker, but {have}")
    ids = gpu_ids(num_gpus, environ)
    num_workers = len(chosen) // size if pool.num_workers == "auto" else pool.num_workers
    envs = tuple(
        {CUDA_VISIBLE_DEVICES: ",".join(ids[chosen[(i * size + r) % len(chosen)]] for r in range(size))}
        for i in range(num_workers)
    )
    used = min(len(chosen), num_workers * size)
    return WorkerPlan(num_workers, envs, tuple(ids[index] for index in chosen[used:]))
