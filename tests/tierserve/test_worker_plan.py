"""One worker per GPU: the pools serve plans, checked on the launcher's command lines with the GPU count
injected (no GPU needed)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

import gateway.tokenizer
import worker.models.store
from gateway.worker_procs import PoolLaunch, threads_arg, worker_command
from tierserve.cli import _pools
from tierserve.worker_plan import gpu_ids, plan_workers
from wire.config import ModelPool, ModelsConfig, ServerConfig

ADDRESS = "tcp://127.0.0.1:1"


@pytest.fixture(autouse=True)
def no_model_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Pools name a folder that need not exist: the plan, not the model, is under test."""
    monkeypatch.setattr(worker.models.store, "resolve_model", lambda path: tmp_path / "model")
    monkeypatch.setattr(
        gateway.tokenizer, "HFPromptBuilder", lambda folder: gateway.tokenizer.BytePromptBuilder()
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _args(**overrides: object) -> argparse.Namespace:
    return argparse.Namespace(
        **({"model": None, "mock": 0, "mock_args": "", "no_workers": False} | overrides)
    )


def _config(*pools: ModelPool) -> ServerConfig:
    return ServerConfig(models=ModelsConfig(pools=pools))


def _launched(
    launches: list[PoolLaunch], config: ServerConfig, log_dir: Path
) -> list[tuple[str, str | None, str]]:
    """(worker id, its CUDA_VISIBLE_DEVICES, its --device) of every worker serve would start."""
    rows = []
    for launch in launches:
        for i in range(launch.num_workers):
            command = worker_command(ADDRESS, i, launch, config, log_dir)
            device = command.argv[command.argv.index("--device") + 1]
            rows.append((command.worker_id, command.env.get("CUDA_VISIBLE_DEVICES"), device))
    return rows


def test_four_gpus_start_four_workers_each_pinned_to_its_own(tmp_path: Path) -> None:
    config = _config(ModelPool(name="m"))  # the defaults: device and num_workers "auto"
    launches = _pools(_args(), config, count_gpus=lambda: 4)
    assert _launched(launches, config, tmp_path) == [(f"m-{i}", str(i), "auto") for i in range(4)]


def test_devices_choose_the_gpus(tmp_path: Path) -> None:
    config = _config(ModelPool(name="m", device="cuda", devices=(1, 3)))
    launches = _pools(_args(), config, count_gpus=lambda: 4)
    assert _launched(launches, config, tmp_path) == [("m-0", "1", "cuda"), ("m-1", "3", "cuda")]


def test_no_gpu_means_one_unpinned_worker_as_before(tmp_path: Path) -> None:
    config = _config(ModelPool(name="m"))
    assert _launched(_pools(_args(), config, count_gpus=lambda: 0), config, tmp_path) == [
        ("m-0", None, "auto")
    ]
    cpu = _config(ModelPool(name="m", device="cpu", num_workers=2))

    def never() -> int:
        raise AssertionError("a CPU pool must not count GPUs (that imports torch)")

    assert _launched(_pools(_args(), cpu, count_gpus=never), cpu, tmp_path) == [
        ("m-0", None, "cpu"),
        ("m-1", None, "cpu"),
    ]


def test_serves_own_cuda_visible_devices_maps_the_indices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    config = _config(ModelPool(name="m", devices=(0, 2)))
    launches = _pools(_args(), config, count_gpus=lambda: 3)
    assert [pin for _, pin, _ in _launched(launches, config, tmp_path)] == ["4", "7"]
    assert gpu_ids(2, {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}) == ["GPU-a", "GPU-b"]


def test_an_explicit_count_shares_the_gpus_round_robin() -> None:
    plan = plan_workers(ModelPool(name="m", num_workers=3, devices=(0, 1)), "p", 2, {})
    assert [env["CUDA_VISIBLE_DEVICES"] for env in plan.worker_envs] == ["0", "1", "0"]


@pytest.mark.parametrize(
    ("pool", "num_gpus", "message"),
    [
        (
            ModelPool(name="m", device="cuda"),
            0,
            'models.pools[0]: device = "cuda", but serve sees no CUDA device',
        ),
        (
            ModelPool(name="m", devices=(1,)),
            0,
            "models.pools[0]: devices = [1], but serve sees no CUDA device",
        ),
        (
            ModelPool(name="m", devices=(0, 2)),
            2,
            "models.pools[0].devices: GPU 2 is not visible (serve sees 2: 0..1)",
        ),
    ],
)
def test_a_gpu_pool_serve_cannot_place_is_an_error_naming_the_key(
    pool: ModelPool, num_gpus: int, message: str
) -> None:
    with pytest.raises(ValueError) as info:
        _pools(_args(), _config(pool), count_gpus=lambda: num_gpus)
    assert str(info.value) == message


def test_mock_and_no_workers_count_no_gpus() -> None:
    def never() -> int:
        raise AssertionError("GPUs counted")

    config = _config(ModelPool(name="m"), ModelPool(name="f", role="fallback", devices=(0, 1)))
    mock = _pools(_args(mock=3), config, count_gpus=never)
    assert [(launch.name, launch.num_workers, launch.worker_envs) for launch in mock] == [
        ("mock", 3, ()),
        ("f", 2, ()),
    ]
    elsewhere = _pools(_args(no_workers=True), config, count_gpus=never)
    assert [launch.num_workers for launch in elsewhere] == [1, 2]  # what the progress lines wait for


def test_a_tensor_parallel_worker_gets_its_gpus_together(tmp_path: Path) -> None:
    config = _config(ModelPool(name="m", path="default", tensor_parallel_size=2))
    launches = _pools(_args(), config, count_gpus=lambda: 4)
    assert _launched(launches, config, tmp_path) == [("m-0", "0,1", "auto"), ("m-1", "2,3", "auto")]
    command = worker_command(ADDRESS, 1, launches[0], config, tmp_path)
    assert command.argv[command.argv.index("--tensor-parallel-size") + 1] == "2"
    chosen = ModelPool(name="m", path="default", tensor_parallel_size=2, devices=(3, 1))
    assert [env["CUDA_VISIBLE_DEVICES"] for env in plan_workers(chosen, "p", 4, {}).worker_envs] == ["3,1"]


def test_gpus_left_over_by_tensor_parallel_groups_are_named_idle(capsys: pytest.CaptureFixture[str]) -> None:
    pool = ModelPool(name="m", path="default", tensor_parallel_size=2)
    plan = plan_workers(pool, "p", 5, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,7"})
    assert [env["CUDA_VISIBLE_DEVICES"] for env in plan.worker_envs] == ["0,1", "2,3"]
    assert plan.idle_gpus == ("7",)
    _pools(_args(), _config(pool), count_gpus=lambda: 3)
    assert "models.pools[0] leaves GPUs 2 idle" in capsys.readouterr().err
    shared = plan_workers(
        ModelPool(name="m", path="default", tensor_parallel_size=2, num_workers=3), "p", 3, {}
    )
    assert [env["CUDA_VISIBLE_DEVICES"] for env in shared.worker_envs] == ["0,1", "2,0", "1,2"]
    assert shared.idle_gpus == ()


def test_a_tensor_parallel_size_beyond_the_gpus_is_an_error_naming_the_key() -> None:
    pool = ModelPool(name="m", path="default", tensor_parallel_size=4)
    with pytest.raises(ValueError) as info:
        plan_workers(pool, "models.pools[0]", 2, {})
    assert str(info.value) == "models.pools[0].tensor_parallel_size: 4 GPUs per worker, but serve sees 2"


def test_on_a_cpu_box_the_cores_are_shared_among_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    config = _config(
        ModelPool(name="m", path="default", device="cpu", tensor_parallel_size=2, num_workers=2),
        ModelPool(name="f", role="fallback", device="cpu"),
    )
    launches = _pools(_args(), config, count_gpus=lambda: 0)
    assert [(launch.num_workers, launch.ranks_per_worker) for launch in launches] == [(2, 2), (1, 1)]
    assert threads_arg(launches) == ["--num-threads", "3"]  # 16 cores, 5 processes
    mock = _pools(_args(mock=2), config)
    assert [launch.ranks_per_worker for launch in mock] == [1, 1]
    assert "--tensor-parallel-size" not in worker_command(ADDRESS, 0, mock[0], config, tmp_path).argv
