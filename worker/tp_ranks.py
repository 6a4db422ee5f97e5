"""A tensor-parallel worker's other ranks: started by rank 0 (the worker daemon), watched, stopped.

    tierserve worker --tensor-parallel-size N ...
      rank 0   this process: the daemon (links, heartbeats, scheduler), an Engine on shard 0
      rank r   a child process (multiprocessing "spawn"): shard r, following rank 0's steps
               (worker/tp_step.py), nothing else: no link, no scheduler

One torch.distributed group over 127.0.0.1: gloo on CPU, NCCL on CUDA (rank r on ``cuda:r`` of the
GPUs the worker sees). A rank that exits takes the whole worker down at once: rank 0 watches its
children and exits 1 when one goes (the gateway sees a lost worker and moves its requests); each
child dies with rank 0 (``PR_SET_PDEATHSIG``). On CPU each rank gets ``num_threads`` (default: the
cores divided among the ranks).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
from datetime import timedelta
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from worker.config import EngineConfig
from worker.devices import is_cuda_device, resolve_device

__all__ = ["TensorParallelRanks"]

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
# How long a collective may wait for a peer. A follower waits in a broadcast for as long as its worker
# is idle, so no timeout short of that; a lost rank is noticed by rank 0's watch and PR_SET_PDEATHSIG.
GROUP_TIMEOUT = timedelta(days=365)


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda:rank`` of the worker's GPUs, or the CPU."""
    return f"cuda:{rank}" if is_cuda_device(device) else device


def _backend(device: str) -> str:
    return "nccl" if is_cuda_device(device) else "gloo"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TensorParallelRanks:
    """Ranks 1..N-1 of this worker, and the watch that stops the worker when one of them exits."""

    def __init__(self, processes: list[BaseProcess]) -> None:
        self.processes = processes
        self._closing = threading.Event()

    @classmethod
    def start(cls, config: EngineConfig, size: int) -> tuple[TensorParallelRanks, EngineConfig]:
        """Start ranks 1..size-1 and join the group as rank 0; returns them and rank 0's engine config."""
        config = resolve_device(config)
        _check_shardable(config, size)  # before any process starts: one clear error, from rank 0
        if config.num_threads is None and not is_cuda_device(config.device):
            config = dataclasses.replace(config, num_threads=max(1, (os.cpu_count() or 1) // size))
        address = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        processes: list[BaseProcess] = [
            context.Process(
                target=_follow, args=(rank, size, address, config), name=f"tp-rank-{rank}", daemon=True
            )
            for rank in range(1, size)
        ]
        for process in processes:
            process.start()
        ranks = cls(processes)  # watched from now on: a rank failing to start stops this one too
        threading.Thread(target=ranks._watch, name="tp-watch", daemon=True).start()
        device = rank_device(config.device, 0)
        if is_cuda_device(device):
            torch.cuda.set_device(device)
        dist.init_process_group(
            _backend(device), init_method=address, rank=0, world_size=size, timeout=GROUP_TIMEOUT
        )
        log.info(
            "tensor parallel: rank 0 of %d here, ranks %s in processes %s (%s)",
            size, list(range(1, size)), [p.pid for p in processes], _backend(device),
        )  # fmt: skip
        rank0 = dataclasses.replace(config, device=device, tensor_parallel_size=size, tensor_parallel_rank=0)
        return ranks, rank0

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        ended = multiprocessing.connection.wait(list(sentinels))
        if self._closing.is_set():
            return
        process = sentinels[ended[0]]  # type: ignore[index]
        process.join(timeout=1)
        log.error(
            "tensor parallel %s (pid %s) exited with code %s: this worker stops, its requests move to others",
            process.name, process.pid, process.exitcode,
        )  # fmt: skip
        logging.shutdown()
        os._exit(1)  # at once: rank 0's next collective would wait for the lost rank

    def close(self, runner: object) -> None:
        """After the engine's last step: the other ranks stop (``runner`` sends STOP) and are joined."""
        self._closing.set()
        close = getattr(runner, "close", None)
        if close is not None:
            close()
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        dist.destroy_process_group()


def _check_shardable(config: EngineConfig, size: int) -> None:
    """``UnsupportedModelError`` when the model cannot be split ``size`` ways (quantized, or a dimension
    that does not divide)."""
    from worker.models.config import UnsupportedModelError, load_model_config
    from worker.models.gguf_model import is_gguf_folder
    from worker.models.hf_quant import is_hf_quantized_folder
    from worker.models.store import resolve_model
    from worker.models.tensor_parallel import plan_shards

    path = resolve_model(config.model)
    if config.quantization != "none" or is_gguf_folder(path) or is_hf_quantized_folder(path):
        raise UnsupportedModelError(
            f"tensor parallelism takes float weights; {config.model!r} is quantized "
            "(the embedded model's float folder is --model default)"
        )
    plan_shards(load_model_config(path), 0, size)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _follow(rank: int, size: int, address: str, config: EngineConfig) -> None:
    """A child rank's whole life: its shard, then rank 0's steps until it says stop."""
    _die_with_parent()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s"
    )
    from worker.model_runner import build_model_runner
    from worker.models.store import resolve_model
    from worker.precision import resolve_dtype
    from worker.tp_step import follow

    device = rank_device(config.device, rank)
    if is_cuda_device(device):
        torch.cuda.set_device(device)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    dist.init_process_group(
        _backend(device), init_method=address, rank=rank, world_size=size, timeout=GROUP_TIMEOUT
    )
    config = resolve_dtype(
        dataclasses.replace(config, device=device, tensor_parallel_size=size, tensor_parallel_rank=rank)
    )
    runner, _, _ = build_model_runner(config, resolve_model(config.model))
    try:
        follow(runner)
    finally:
        dist.destroy_process_group()
