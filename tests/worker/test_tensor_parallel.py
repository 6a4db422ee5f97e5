"""Tensor parallelism on CPU: two real processes over gloo — rank 0 an Engine (scheduler, sampler) on
its shard, rank 1 following the steps rank 0 sends — give the greedy tokens one unsharded engine
gives, on tiny models of every attention layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loadtest.launch import free_port
from tests.worker.test_models_tiny import _save_hf
from wire.byte_tokenizer import ByteTokenizer
from wire.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import Engine
from worker.model_runner import build_model_runner
from worker.models.config import UnsupportedModelError, load_model_config
from worker.models.tensor_parallel import plan_shards
from worker.policy_set import WorkerPolicies
from worker.tp_step import TensorParallelRunner, follow

pytestmark = pytest.mark.timeout(300)

# (name, what it covers): K/V heads split (2 of 4 over 2 ranks), replicated (Qwen2's one), every
# head its own K/V (Mistral, with a sliding window), biases on o_proj and the MLP (added once), tied
# and untied logits
MODELS = [
    "llama-tied",
    "llama-gqa-untied",
    "qwen2-qkv-bias-yarn",
    "mistral-sliding-window",
    "llama-biases-linear-rope",
]
PROMPTS = [[3 + (i * 11 + j) % 200 for j in range(n)] for i, n in enumerate((2, 9, 17, 30, 5))]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _config(path: Path, world: int = 1, rank: int = 0) -> EngineConfig:
    return EngineConfig(
        model=str(path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8, max_num_seqs=8,
        cpu_kernels=False, tensor_parallel_size=world, tensor_parallel_rank=rank,
    )  # fmt: skip


def _engine(path: Path, world: int = 1, rank: int = 0) -> Engine:
    config = _config(path, world, rank)
    runner, model_config, num_blocks = build_model_runner(config, path)
    return Engine(config, ByteTokenizer(), runner, model_config, num_blocks, WorkerPolicies.tiered())


def _rank(rank: int, world: int, address: str, folders: list[Path], results: dict[str, Any]) -> None:
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for folder in folders:
            if rank == 0:
                engine = _engine(folder, world, rank)
                results[folder.name] = [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]
                assert isinstance(engine.runner, TensorParallelRunner)
                engine.runner.close()
                results[f"{folder.name} steps"] = engine.runner.num_steps_sent
            else:
                runner, _, _ = build_model_runner(_config(folder, world, rank), folder)
                results[f"{folder.name} followed"] = follow(runner)
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_the_greedy_tokens_of_one(tmp_path: Path) -> None:
    folders = []
    for name in MODELS:
        _save_hf(name, tmp_path / name)
        folders.append(tmp_path / name)
    with mp.Manager() as manager:
        results = manager.dict()
        address = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(_rank, args=(2, address, folders, results), nprocs=2, join=True)
        sharded = dict(results)
    for folder in folders:
        alone = [c.token_ids for c in _engine(folder).generate(PROMPTS, PARAMS)]
        assert sharded[folder.name] == alone, folder.name
        assert sharded[f"{folder.name} followed"] == sharded[f"{folder.name} steps"] >= PARAMS.max_tokens
        assert all(len(tokens) == PARAMS.max_tokens for tokens in alone)


@pytest.mark.parametrize(
    ("name", "world", "q_heads", "kv_heads"),
    [
        ("llama-gqa-untied", 2, [range(0, 2), range(2, 4)], [range(0, 1), range(1, 2)]),  # 4 q, 2 kv: split
        ("qwen2-qkv-bias-yarn", 2, [range(0, 2), range(2, 4)], [range(0, 1), range(0, 1)]),  # 1 kv: shared
        (
            "llama-gqa-untied",
            4,
            [range(i, i + 1) for i in range(4)],
            [range(i // 2, i // 2 + 1) for i in range(4)],
        ),
    ],
)
def test_the_plan_splits_heads_or_replicates_kv(
    name: str, world: int, q_heads: list[range], kv_heads: list[range], tmp_path: Path
) -> None:
    _save_hf(name, tmp_path)
    config = load_model_config(tmp_path)
    plans = [plan_shards(config, rank, world) for rank in range(world)]
    assert [p.q_heads for p in plans] == q_heads
    assert [p.kv_heads for p in plans] == kv_heads
    # the MLP channels and the vocabulary are covered once, in rank order
    assert [i for p in plans for i in p.inter] == list(range(config.intermediate_size))
    assert [i for p in plans for i in p.vocab] == list(range(config.vocab_size))


def test_what_does_not_divide_is_refused_by_name(tmp_path: Path) -> None:
    _save_hf("llama-gqa-untied", tmp_path)  # 4 query heads, 2 K/V heads, 128 MLP channels
    config = load_model_config(tmp_path)
    with pytest.raises(
        UnsupportedModelError, match="num_attention_heads 4 does not divide by tensor_parallel_size 3"
    ):
        plan_shards(config, 0, 3)
    with pytest.raises(ValueError, match=r"rank 2 is not in 0\.\.1"):
        plan_shards(config, 2, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_rank 2 is not in 0\.\.1"):
        EngineConfig(tensor_parallel_size=2, tensor_parallel_rank=2)


def test_a_quantized_model_is_refused_before_any_communication(tmp_path: Path) -> None:
    _save_hf("llama-gqa-untied", tmp_path)
    config = EngineConfig(
        model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16, quantization="int8",
        tensor_parallel_size=2,
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="takes float weights; this model is quantized"):
        build_model_runner(config, tmp_path)
