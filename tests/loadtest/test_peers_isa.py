"""The peers held to tierserve's ISA level (``peers_isa``): torch's probes through the written
``sitecustomize`` in a real interpreter, and vLLM's kernel library read from a real process's maps."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.peers_install import LLAMACPP_VARIANTS, llamacpp_cmake
from loadtest.peers_isa import (
    LLAMACPP_VARIANT,
    TORCH_PROBES,
    capped_probes,
    peer_level,
    vllm_env,
    vllm_kernels,
)
from worker.cpu_isa import IsaLevel, caps_from_flags

pytestmark = pytest.mark.timeout(120)

AMX_CPU = {"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} | {
    "amx_tile",
    "amx_bf16",
}


def test_the_peers_follow_only_an_override_and_never_below_avx2() -> None:
    assert peer_level(caps_from_flags(AMX_CPU)) is None
    assert peer_level(caps_from_flags(AMX_CPU, override="avx2")) is IsaLevel.AVX2
    assert peer_level(caps_from_flags(AMX_CPU, override="avx512")) is IsaLevel.AVX512
    assert peer_level(caps_from_flags(AMX_CPU, override="default")) is IsaLevel.AVX2
    avx2_cpu = {"avx", "avx2", "fma"}
    assert peer_level(caps_from_flags(avx2_cpu, override="default")) is None  # AVX2 is the CPU's own


def test_each_level_caps_the_probes_above_it_and_has_a_llamacpp_build() -> None:
    assert capped_probes(IsaLevel.AMX) == []
    assert capped_probes(IsaLevel.AVX512_BF16) == ["_is_amx_tile_supported", "_is_amx_fp16_supported"]
    assert capped_probes(IsaLevel.AVX2) == list(TORCH_PROBES)
    for level in IsaLevel:
        if level >= IsaLevel.AVX2:
            assert LLAMACPP_VARIANT[level] in LLAMACPP_VARIANTS
    assert "-mno-avx512f" in " ".join(llamacpp_cmake("avx2"))
    assert llamacpp_cmake("native") == [a for a in llamacpp_cmake("avx2") if "FLAGS" not in a]


def test_the_shim_makes_torch_answer_for_the_lower_level(tmp_path: Path) -> None:
    env = vllm_env(IsaLevel.AVX2, tmp_path)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    names = [*TORCH_PROBES, "_is_avx2_supported"]
    code = f"import torch.cpu; print([getattr(torch.cpu, n)() for n in {names!r}])"
    child_env = {k: v for k, v in os.environ.items() if k not in ("TIERSERVE_CPU_ISA", "PYTHONPATH")}
    answers = subprocess.run(
        [sys.executable, "-c", code], env={**child_env, **env}, capture_output=True, text=True, check=True
    ).stdout.strip()
    import torch.cpu

    avx2 = torch.cpu._is_avx2_supported()
    assert answers == str([False] * len(TORCH_PROBES) + [avx2])


def test_vllm_kernels_are_read_from_the_maps_of_the_servers_session(tmp_path: Path) -> None:
    library = tmp_path / "site-packages" / "vllm" / "_C_AVX2.abi3.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\0" * 4096)
    holds = (
        f"import mmap, sys; f = open({str(library)!r}, 'rb'); "
        "m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); print('mapped', flush=True); sys.stdin.read()"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", holds], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"mapped"
        assert vllm_kernels(server.pid) == ["_C_AVX2"]
        assert vllm_kernels(os.getsid(0)) == []  # our own session maps no vLLM library
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 10
    while vllm_kernels(server.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert vllm_kernels(server.pid) == []
