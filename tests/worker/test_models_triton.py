"""The whole model through the Triton kernels (Triton's interpreter on CPU), against Hugging Face and
against the torch path: the schedule of test_models_tiny, then the engine end to end, with and without
the static decode buffers CUDA graphs replay (on CPU they run eagerly; the capture itself is GPU-only).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.triton_ops is first imported
pytest.importorskip("triton")

import transformers

from tests.worker.test_models_tiny import BLOCK_SIZE, NUM_BLOCKS, TINY, _save_hf
from wire.byte_tokenizer import ByteTokenizer
from wire.sampling import SamplingParams
from worker.attention import (
    AttentionMetadata,
    KernelBackend,
    TritonPagedAttention,
    allocate_kv_cache,
)
from worker.config import EngineConfig
from worker.decode_graphs import DecodeGraphs
from worker.engine import Engine
from worker.model_runner import ModelRunner, build_model_runner
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import load_model
from worker.precision import resolve_dtype

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _use_triton(model: LlamaForCausalLM) -> None:
    from kernels.triton_ops.layer_ops import TritonLayerOps

    model.use_kernels(TritonLayerOps(), TritonPagedAttention())


def _step(
    model: LlamaForCausalLM,
    kv_caches: list[torch.Tensor],
    tables: dict[str, list[int]],
    tokens: dict[str, list[int]],
    chunks: list[tuple[str, int, int]],
    num_decodes: int,
) -> torch.Tensor:
    input_ids, positions, slots, starts, seq_lens = [], [], [], [0], []
    for name, start, end in chunks:
        table = tables[name]
        input_ids += tokens[name][start:end]
        positions += range(start, end)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
        starts.append(starts[-1] + end - start)
        seq_lens.append(end)
    width = max(len(tables[name]) for name, _, _ in chunks)
    block_tables = torch.zeros(len(chunks), width, dtype=torch.int64)
    for row, (name, _, _) in enumerate(chunks):
        block_tables[row, : len(tables[name])] = torch.tensor(tables[name])
    meta = AttentionMetadata.build(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=block_tables.to(DEVICE),
        num_decodes=num_decodes,
        block_size=BLOCK_SIZE,
        sliding_window=model.config.sliding_window,
        backend=KernelBackend.TRITON,
    )
    with torch.inference_mode():
        ids, pos = torch.tensor(input_ids, device=DEVICE), torch.tensor(positions, device=DEVICE)
        return model.compute_logits(model(ids, pos, kv_caches, meta)).cpu()


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-qkv-bias-yarn", "mistral-sliding-window"])
def test_triton_model_matches_hf(name: str, tmp_path: Path) -> None:
    hf_model = _save_hf(name, tmp_path)
    model, config = load_model(tmp_path, torch.float32, DEVICE)
    _use_triton(model)
    gen = torch.Generator().manual_seed(2)
    tokens = {
        "A": torch.randint(0, 256, (25,), generator=gen).tolist(),
        "B": torch.randint(0, 256, (19,), generator=gen).tolist(),
    }
    with torch.no_grad():
        expected = {k: hf_model(torch.tensor([v])).logits[0] for k, v in tokens.items()}
    kv_caches = allocate_kv_cache(
        config.num_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float32, DEVICE
    )
    free = list(range(NUM_BLOCKS))
    random.Random(1).shuffle(free)
    tables = {k: [free.pop() for _ in range(-(-len(v) // BLOCK_SIZE))] for k, v in tokens.items()}

    def step(chunks: list[tuple[str, int, int]], num_decodes: int) -> torch.Tensor:
        return _step(model, kv_caches, tables, tokens, chunks, num_decodes)

    tol = {"atol": 1e-4, "rtol": 1e-4}
    got = step([("A", 0, 12), ("B", 0, 13)], 0)
    torch.testing.assert_close(got[:12], expected["A"][:12], **tol)
    torch.testing.assert_close(got[12:], expected["B"][:13], **tol)
    got = step([("B", 13, 14), ("A", 12, 20)], 1)  # a decode and a chunk with a 12-token prefix
    torch.testing.assert_close(got[0], expected["B"][13], **tol)
    torch.testing.assert_close(got[1:], expected["A"][12:20], **tol)
    for i in range(3):
        got = step([("A", 20 + i, 21 + i), ("B", 14 + i, 15 + i)], 2)
        torch.testing.assert_close(got[0], expected["A"][20 + i], **tol)
        torch.testing.assert_close(got[1], expected["B"][14 + i], **tol)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 260})
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _engine(path: Path, backend: str, graphs: bool = False) -> Engine:
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        device=str(DEVICE),
        num_kv_blocks=64,
        block_size=8,
        max_num_seqs=4,
        kernel_backend=backend,
        max_num_batched_tokens=64,
        cuda_graphs=False,  # eager: the reference the graphed paths are compared with
    )
    runner, model_config, num_blocks = build_model_runner(config, path)
    if graphs:  # the static-buffer decode path, run eagerly: buckets 1, 2, 4 with padding
        runner.decode_step = DecodeGraphs(runner.model, runner.kv_caches, 8, 96, [1, 2, 4], DEVICE)
    return Engine(config, ByteTokenizer(), runner, model_config, num_blocks)


def test_engine_greedy_tokens_match_the_torch_path(tiny_checkpoint: Path) -> None:
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 30)]  # 3 requests: the 4-bucket pads one row
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [c.token_ids for c in _engine(tiny_checkpoint, "torch").generate(prompts, params)]
    triton_engine = _engine(tiny_checkpoint, "triton")
    assert isinstance(triton_engine.runner, ModelRunner)
    assert triton_engine.runner.backend is KernelBackend.TRITON
    assert [c.token_ids for c in triton_engine.generate(prompts, params)] == expected
    graphed = _engine(tiny_checkpoint, "triton", graphs=True)
    runner = graphed.runner
    assert isinstance(runner, ModelRunner) and isinstance(runner.decode_step, DecodeGraphs)
    buckets: list[int] = []
    graphs = runner.decode_step
    run = graphs.run
    graphs.run = lambda *args: (buckets.append(graphs.bucket(len(args[0]))), run(*args))[1]  # type: ignore
    assert [c.token_ids for c in graphed.generate(prompts, params)] == expected
    assert buckets and set(buckets) == {4}, "decode steps of 3 sequences replay the padded 4-bucket"
    assert len(set(map(tuple, expected))) > 1, "the prompts should not all continue alike"


@pytest.mark.isa
def test_backend_choice(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = resolve_dtype(EngineConfig(model=str(tiny_checkpoint), num_kv_blocks=8, device=DEVICE.type))
    runner, _, _ = build_model_runner(config, tiny_checkpoint)
    assert runner.backend is (KernelBackend.TRITON if DEVICE.type == "cuda" else KernelBackend.TORCH)
    if DEVICE.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            build_model_runner(
                resolve_dtype(EngineConfig(model=str(tiny_checkpoint), kernel_backend="triton")),
                tiny_checkpoint,
            )
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs=True, device="cpu")
    with pytest.raises(ValueError, match="kernel_backend"):
        EngineConfig(kernel_backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_replay_matches_eager(tiny_checkpoint: Path) -> None:
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 30)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = [c.token_ids for c in _engine(tiny_checkpoint, "triton").generate(prompts, params)]
    config = EngineConfig(
        model=str(tiny_checkpoint),
        dtype="float32",
        device="cuda",
        num_kv_blocks=64,
        block_size=8,
        max_num_seqs=4,
        cuda_graphs=True,
        max_model_len=96,
    )
    runner, model_config, num_blocks = build_model_runner(config, tiny_checkpoint)
    assert isinstance(runner.decode_step, DecodeGraphs) and sorted(runner.decode_step.graphs) == [1, 2, 4]
    engine = Engine(config, ByteTokenizer(), runner, model_config, num_blocks)
    assert [c.token_ids for c in engine.generate(prompts, params)] == eager
