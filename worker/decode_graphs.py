"""CUDA graphs of decode-only steps (``DecodeGraphs``), one per batch-size bucket, and their builder.

The model runner's ``DecodeStep`` on CUDA with the Triton kernels (``cuda_graphs``, on by default
there): a decode step of B sequences replays the graph of the smallest bucket >= B.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from worker.attention import AttentionMetadata, KernelBackend, TritonStepTensors
from worker.config import EngineConfig
from worker.models.config import ModelConfig
from worker.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets up to ``max_num_seqs`` (always included): padding wastes at most a third of a step."""
    return sorted({b for b in GRAPH_BATCH_SIZES if b < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """CUDA graphs of decode-only steps, one per batch-size bucket, sharing one memory pool.

    The graphs read static device buffers, refilled before each replay (two host-to-device copies)::

        header [4, max_batch] int64    row 0 input ids | 1 positions | 2 slots | 3 seq_lens
        tables [max_batch, max_blocks] block table rows (only the columns a step needs are rewritten)

    A step of B sequences replays the smallest bucket b >= B. Rows B..b-1 are padding sequences: token 0
    at position 0, slot -1 (the store kernel skips it), seq_len 1 over whatever block id their table row
    holds (a valid one: zeros, or a block of an earlier step; read, never written); their output rows are
    dropped. The decode kernel's splits are sized for ``max_model_len``, so one graph per bucket serves
    every context length (at the cost of some idle split programs on short contexts).

    ``capture()`` needs CUDA. Without it (``run`` before ``capture``) the same static buffers and
    metadata run eagerly, which is how CPU tests exercise all of this but the capture itself.
    """

    takes_prefill = False  # a graph's rows are one decode token per sequence

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        batch_sizes: list[int],
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch = self.batch_sizes[-1]
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)
        self.header = torch.zeros(4, self.max_batch, dtype=torch.int64, device=device)
        self.header[2].fill_(-1)
        self.header[3].fill_(1)
        self.tables = torch.zeros(self.max_batch, max_blocks, dtype=torch.int64, device=device)
        query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int64, device=device)
        self.metas = {
            b: AttentionMetadata(
                slot_mapping=self.header[2, :b],
                query_start_loc=list(range(b + 1)),
                seq_lens=[1] * b,  # host copy unused by the Triton backend; the device row is header[3]
                block_tables=self.tables[:b],
                num_decodes=b,
                block_size=block_size,
                plan=TritonStepTensors(self.header[3, :b], query_start_loc[: b + 1], max_model_len, 0),
                sliding_window=model.config.sliding_window,
            )
            for b in self.batch_sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def can_run(self, seq_lens: list[int], in_prompt: list[bool]) -> bool:  # decodes only: no prompt rows
        return len(seq_lens) <= self.max_batch and max(seq_lens) <= self.max_model_len

    def bucket(self, num_seqs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]

    def _forward(self, batch: int) -> torch.Tensor:
        return self.model(self.header[0, :batch], self.header[1, :batch], self.kv_caches, self.metas[batch])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones then fit in its pool memory). The
        buffers hold padding (slot -1), so neither the warm-up nor the capture writes the cache."""
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.batch_sizes):
            self._forward(batch)  # warm-up: Triton compiles and cuBLAS picks kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._forward(batch)
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_rows: list[list[int]],
        in_prompt: list[bool],
    ) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only step (one token per sequence; a one-token
        prompt chunk too: the graphs' attention does not tell prompt rows from output rows)."""
        num_seqs = len(input_ids)
        batch = self.bucket(num_seqs)
        pad = batch - num_seqs
        header = torch.tensor(
            [input_ids + [0] * pad, positions + [0] * pad, slot_mapping + [-1] * pad, seq_lens + [1] * pad],
            dtype=torch.int64,
        )
        self.header[:, :batch].copy_(header)
        width = max(len(row) for row in block_rows)
        tables = torch.tensor([row + [0] * (width - len(row)) for row in block_rows], dtype=torch.int64)
        self.tables[:num_seqs, :width].copy_(tables)
        graph = self.graphs.get(batch)
        if graph is None:
            return self._forward(batch)[:num_seqs]
        graph.replay()
        return self.outputs[batch][:num_seqs]


def decode_graphs(
    config: EngineConfig,
    model: LlamaForCausalLM,
    kv_caches: list[torch.Tensor],
    mc: ModelConfig,
    device: torch.device,
    backend: KernelBackend,
) -> DecodeGraphs | None:
    """Captured decode graphs, or None. ``cuda_graphs`` None (auto): on with the Triton kernels on
    CUDA; False: off; True: on, or a ``ValueError`` where they cannot run."""
    can_capture = backend is KernelBackend.TRITON and device.type == "cuda"
    if config.cuda_graphs and not can_capture:
        raise ValueError("cuda_graphs: needs the Triton kernels on a cuda device")
    if config.cuda_graphs is False or not can_capture:
        if device.type == "cuda":
            why = "cuda_graphs = false" if config.cuda_graphs is False else f"kernels {backend.value}"
            log.info("engine: CUDA graphs off (%s): decode steps run eagerly", why)
        return None
    max_model_len = config.context_limit(mc.max_position_embeddings)
    sizes = graph_batch_sizes(config.max_num_seqs)
    graphs = DecodeGraphs(model, kv_caches, config.block_size, max_model_len, sizes, device)
    start = time.perf_counter()
    graphs.capture()
    log.info(
        "engine: CUDA graphs captured for decode batch sizes %s (max_model_len %d) in %.1f s",
        sizes,
        max_model_len,
        time.perf_counter() - start,
    )
    return graphs
