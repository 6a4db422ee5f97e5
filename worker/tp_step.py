"""A tensor-parallel engine's steps: rank 0 schedules, and sends each step to the other ranks as tensors.

    rank 0   Engine ─ Scheduler ─ TensorParallelRunner.forward(step) ─▶ broadcast ─▶ its shard's forward
    rank r   follow(runner): receive a step ─▶ the same forward on its shard (its logits dropped)

Only rank 0 has a scheduler, so the policies (budgets timed by the wall clock, tiers) never have to
agree across processes; the other ranks run exactly the steps rank 0 runs, and their collectives
(``worker/models/tensor_parallel.py``'s all-reduces and all-gather) meet rank 0's.

On the wire (torch.distributed broadcasts from rank 0, never pickle): a header of ``HEADER_LEN``
int64 — command, tokens T, sequences S, block-table width B, decodes, sampled rows L — then, for a
step, one int64 payload: input ids, positions and slots [T each], query_start_loc [S + 1], seq_lens
[S], the block tables [S × B] and the sampled rows [L]. ``STOP`` ends the followers' loop.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from worker.model_runner import ModelRunner, StepInputs

__all__ = ["TensorParallelRunner", "follow", "receive_step", "send_step", "send_stop"]

log = logging.getLogger(__name__)

HEADER_LEN = 6
STOP, STEP = 0, 1


def _device() -> torch.device:
    """Where collectives' tensors live: NCCL moves CUDA tensors, gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_step(step: StepInputs) -> None:
    """Rank 0: ``step`` to every other rank."""
    tables = step.block_tables()
    num_seqs, width = tables.shape
    header = [STEP, len(step.input_ids), num_seqs, width, step.num_decodes, len(step.logits_indices)]
    device = _device()
    dist.broadcast(torch.tensor(header, dtype=torch.int64, device=device), src=0)
    payload = torch.cat(
        [
            torch.tensor(
                [*step.input_ids, *step.positions, *step.slot_mapping, *step.query_start_loc, *step.seq_lens],
                dtype=torch.int64,
            ),
            tables.flatten(),
            torch.tensor(step.logits_indices, dtype=torch.int64),
        ]
    )
    dist.broadcast(payload.to(device), src=0)


def send_stop() -> None:
    """Rank 0: the followers' loops end."""
    dist.broadcast(torch.tensor([STOP] + [0] * (HEADER_LEN - 1), dtype=torch.int64, device=_device()), src=0)


def receive_step() -> StepInputs | None:
    """A rank other than 0: the next step, or None once rank 0 said stop."""
    device = _device()
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    command, num_tokens, num_seqs, width, num_decodes, num_sampled = header.tolist()
    if command == STOP:
        return None
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width, num_sampled]
    received = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(received, src=0)
    values = received.cpu()
    ids, positions, slots, starts, lens, tables, sampled = values.split(sizes)
    rows = tables.view(num_seqs, width).tolist()
    return StepInputs(
        input_ids=ids.tolist(),
        positions=positions.tolist(),
        slot_mapping=slots.tolist(),
        query_start_loc=starts.tolist(),
        seq_lens=lens.tolist(),
        block_ids=rows,
        num_decodes=num_decodes,
        logits_indices=sampled.tolist(),
    )


class TensorParallelRunner(ModelRunner):
    """A rank's runner; on rank 0 each step goes to the other ranks before its own forward."""

    num_steps_sent = 0

    def forward(self, step: StepInputs) -> torch.Tensor:
        if dist.get_rank() != 0:
            return super().forward(step)
        try:
            send_step(step)
            self.num_steps_sent += 1
            return super().forward(step)
        except Exception:
            # A failed collective is a lost rank (gloo: connection reset), and any failure here leaves the
            # ranks out of step: the worker goes down at once, as tp_ranks' watch does when a rank exits,
            # so the gateway moves its requests. Failing only this step's requests (the engine's own
            # handling) raced the watch and ended the streams with an error instead.
            log.exception("tensor parallel step failed on rank 0: this worker stops, its requests move")
            logging.shutdown()
            os._exit(1)

    def close(self) -> None:
        """Rank 0, once it runs no more steps: the followers return."""
        if dist.get_rank() == 0:
            send_stop()


@torch.inference_mode()
def follow(runner: ModelRunner) -> int:
    """A rank other than 0: run rank 0's steps on this shard until it says stop; the steps run."""
    num_steps = 0
    while (step := receive_step()) is not None:
        ModelRunner.forward(runner, step)
        num_steps += 1
    log.info("tensor parallel rank %d: stopped after %d steps", dist.get_rank(), num_steps)
    return num_steps
