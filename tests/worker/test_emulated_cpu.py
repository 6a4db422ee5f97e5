"""The engine on CPUs this machine is not: QEMU's user-mode emulator (``qemu-x86_64 -cpu MODEL``) runs
a selection of this suite's CPU-specific tests in a Python whose CPUID says Haswell (AVX2 + FMA, no
AVX-512) or Nehalem (SSE4.2, no AVX), whatever this machine has. ``make test`` fetches the emulator
(scripts/fetch_qemu.sh: Debian's qemu-user-static into .cache/qemu); without it these skip.

There, an instruction above the emulated CPU anywhere on the path the engine takes (our kernels, or a
torch kernel we choose) kills the process with SIGILL, where ``TIERSERVE_CPU_ISA=avx2`` on an AVX-512
machine only chooses the AVX2 code and would run a stray AVX-512 instruction without a word. The
emulated process reads this machine's /proc/cpuinfo, so the probe must take CPUID's word
(``worker.cpu_isa.cpuid_denied``); ``test_cpu_isa`` checks the level it finds there
(``TIERSERVE_EXPECT_CPU_LEVEL``). Emulated vector arithmetic runs thousands of times slower than
native (a 32 x 576 x 576 matmul at ~16 MFLOPS), hence tiny models: a few minutes a CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from worker.cpu_isa import OVERRIDE_ENV, IsaLevel, library_isa_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QEMU = ROOT / ".cache" / "qemu" / "qemu-x86_64"
EXPECT_ENV = "TIERSERVE_EXPECT_CPU_LEVEL"

# (QEMU's CPU model, the level the probe must find, the tests run there)
CPUS = [
    (
        "Haswell-v4",
        "avx2",
        [
            "tests/worker/test_cpu_isa.py",
            # the fused float32 and quantized layers against the torch path on the AVX2 builds (decodes,
            # and prompts' chunks in tiles)
            "tests/kernels/test_cpu_decode.py::test_fused_mixed_step_equals_the_torch_path",
            "tests/kernels/test_cpu_decode.py::test_fused_quantized_step_equals_the_torch_path",
            "tests/worker/test_cpu_linear.py",
            # the engine on the path the probe chose (the fused AVX2 layer), token for token vs HF
            "tests/worker/test_engine_tiny.py",
        ],
    ),
    (
        "Nehalem-v2",
        "default",
        [
            "tests/worker/test_cpu_isa.py",
            # no AVX: the fused kernels stay unloaded and the torch path serves, token for token vs HF
            "tests/worker/test_engine_tiny.py",
        ],
    ),
]


def emulator() -> Path | None:
    if QEMU.is_file() and os.access(QEMU, os.X_OK):
        return QEMU
    found = shutil.which("qemu-x86_64") or shutil.which("qemu-x86_64-static")
    return Path(found) if found else None


def child_env(level: str) -> dict[str, str]:
    """This environment less what would hold the child below its CPU (make test's second pass sets
    them), and the level its probe must find."""
    drop = {OVERRIDE_ENV, *library_isa_env(IsaLevel.AVX2)}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env[EXPECT_ENV] = level
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.parametrize(("cpu", "level", "tests"), CPUS, ids=[cpu for cpu, _, _ in CPUS])
def test_the_engine_on_an_emulated_cpu(cpu: str, level: str, tests: list[str]) -> None:
    if os.environ.get(OVERRIDE_ENV):
        pytest.skip(f"the emulated CPUs are their own level: run once, without {OVERRIDE_ENV}")
    qemu = emulator()
    if qemu is None:
        pytest.skip("no qemu-x86_64: `make test` fetches it (scripts/fetch_qemu.sh .cache/qemu)")
    command = [str(qemu), "-cpu", cpu, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "-m", "not gpu", *tests],
        cwd=ROOT,
        env=child_env(level),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    # QEMU names each CPUID feature of the model that it does not emulate, once a process
    output = "\n".join(
        line for line in (done.stdout + done.stderr).splitlines() if "TCG doesn't support" not in line
    )
    tail = "\n".join(output.splitlines()[-40:])
    assert "Illegal instruction" not in output, f"SIGILL on an emulated {cpu}:\n{tail}"
    assert done.returncode == 0, f"on an emulated {cpu} ({level}), rc {done.returncode}:\n{tail}"
    assert " passed" in output and " failed" not in output, tail
