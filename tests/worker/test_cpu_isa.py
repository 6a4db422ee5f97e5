"""The CPU probe's decisions for each kind of CPU: flags in, level, dtype and transforms out."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from worker.cpu_isa import (
    ISA_FLAGS,
    OVERRIDE_ENV,
    CpuIsaError,
    IsaLevel,
    caps_from_flags,
    cpuid_denied,
    export_isa_env,
    level_of,
    parse_level,
    probe,
    read_cpuinfo,
)
from worker.precision import choose_dtype

# /proc/cpuinfo flag sets (ISA flags only) of CPUs our users run on.
SSE_ONLY = {"sse", "sse2", "sse4_1", "sse4_2", "popcnt"}
AVX2 = SSE_ONLY | {"avx", "avx2", "fma", "f16c"}  # e.g. an AMD EPYC Rome VM, Intel Haswell
AVX2_NE_CONVERT = AVX2 | {"avx_vnni", "avx_ne_convert"}  # Intel client cores (Meteor Lake, Arrow Lake)
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}  # Skylake-SP
AVX512_BF16 = AVX512 | {"avx512_bf16", "avx512_vbmi2", "avx512_bitalg"}  # AMD Zen 4, Cooper Lake
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}  # Intel Sapphire Rapids
F_ONLY = AVX2 | {"avx512f"}  # a VM that passes through part of AVX-512: not enough for oneDNN's bf16

CASES = [
    # flags, level, native bf16, oneDNN bf16 packing, dtype "auto"
    (SSE_ONLY, IsaLevel.DEFAULT, False, False, "float32"),
    (AVX2, IsaLevel.AVX2, False, False, "float32"),
    (AVX2_NE_CONVERT, IsaLevel.AVX2, False, True, "float32"),
    (F_ONLY, IsaLevel.AVX2, False, False, "float32"),
    (AVX512, IsaLevel.AVX512, False, True, "float32"),
    (AVX512_BF16, IsaLevel.AVX512_BF16, True, True, "bfloat16"),
    (AMX, IsaLevel.AMX, True, True, "bfloat16"),
]


@pytest.mark.parametrize(("flags", "level", "native", "packs", "auto"), CASES)
def test_each_cpu_kind(flags: set[str], level: IsaLevel, native: bool, packs: bool, auto: str) -> None:
    caps = caps_from_flags(flags, "test CPU")
    assert (caps.level, caps.native_level) == (level, level)
    assert caps.native_bf16 is native
    assert caps.can_pack_bf16 is packs
    assert choose_dtype("auto", "cpu", caps).dtype == auto
    assert choose_dtype("float32", "cpu", caps).dtype == "float32"


@pytest.mark.parametrize(("flags", "level", "native", "packs", "auto"), CASES)
def test_explicit_bf16_is_kept_and_warned_about_where_it_is_not_native(
    flags: set[str], level: IsaLevel, native: bool, packs: bool, auto: str
) -> None:
    choice = choose_dtype("bfloat16", "cpu", caps_from_flags(flags))
    assert choice.dtype == "bfloat16"
    assert (choice.warning is None) is native
    if not native:
        assert level.label in (choice.warning or "") and "float32" in (choice.warning or "")


def test_cuda_auto_is_bf16_or_fp16_and_ignores_the_cpu() -> None:
    assert choose_dtype("auto", "cuda", None).dtype == "bfloat16"
    assert choose_dtype("auto", "cuda:1", None, cuda_bf16=False).dtype == "float16"
    assert choose_dtype("float32", "cuda", None).dtype == "float32"


@pytest.mark.parametrize("override", ["avx2", "AVX2", " avx2 "])
def test_override_lowers_the_level_and_every_decision(override: str) -> None:
    caps = caps_from_flags(AMX, override=override)
    assert (caps.native_level, caps.level) == (IsaLevel.AMX, IsaLevel.AVX2)
    assert caps.is_overridden
    assert not caps.native_bf16 and not caps.can_pack_bf16
    assert caps.flags == AMX & {"avx", "avx2", "fma", "f16c"}
    assert choose_dtype("auto", "cpu", caps).dtype == "float32"
    assert "the CPU has amx" in caps.describe()


def test_override_to_avx512_keeps_packing_but_not_native_bf16() -> None:
    caps = caps_from_flags(AVX512_BF16, override="avx512")
    assert caps.level is IsaLevel.AVX512
    assert caps.can_pack_bf16 and not caps.native_bf16
    assert "avx512_bf16" not in caps.flags


def test_override_cannot_raise_the_level(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        caps = caps_from_flags(AVX2, override="amx")
    assert caps.level is IsaLevel.AVX2 and not caps.is_overridden
    assert "more than this CPU offers" in caplog.text


def test_onednn_saying_no_stops_packing_whatever_the_flags() -> None:
    assert not caps_from_flags(AVX512_BF16, onednn_bf16=False).can_pack_bf16


# What CPUID confirms on an emulated CPU (qemu-x86_64 -cpu MODEL) while /proc/cpuinfo is the host's
HASWELL = AVX2
NEHALEM = SSE_ONLY


@pytest.mark.parametrize(("executes", "level"), [(NEHALEM, IsaLevel.DEFAULT), (HASWELL, IsaLevel.AVX2)])
def test_flags_cpuid_denies_are_dropped(executes: set[str], level: IsaLevel) -> None:
    """/proc/cpuinfo of an AMX host, read by a process that executes less: the level and the flags
    are what runs."""
    denied = (AMX - executes) & ISA_FLAGS
    caps = caps_from_flags(AMX, "host CPU", denied=denied)
    assert (caps.native_level, caps.level) == (level, level)
    assert caps.flags == frozenset(executes & ISA_FLAGS)
    assert not caps.native_bf16 and not caps.can_pack_bf16
    assert choose_dtype("auto", "cpu", caps).dtype == "float32"
    # an override still lowers, and cannot raise past what executes
    assert caps_from_flags(AMX, override="avx512_bf16", denied=denied).level is level


def test_a_denied_extension_leaves_its_level_and_drops_the_extension() -> None:
    """AVX-512 core confirmed, VNNI denied: the level stays, and the quantized kernels' VNNI tile
    (worker.models.quant checks the flag) is not chosen."""
    caps = caps_from_flags(AVX512, denied={"avx512_vnni"})
    assert caps.level is IsaLevel.AVX512 and "avx512_vnni" not in caps.flags


def test_cpuid_denied_reads_torchs_cpuinfo_in_proc_cpuinfo_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    answers = {"avx2": True, "fma3": True, "avx512_f": False, "avx512_vnni": False, "amx_tile": False}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: answers)
    # only what cpuinfo answers False to: a flag it does not know is not denied
    assert cpuid_denied() == {"avx512f", "avx512_vnni", "amx_tile"}
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    assert cpuid_denied() == frozenset()  # a torch without it: the flags alone


def test_this_cpus_flags_are_what_cpuid_confirms() -> None:
    """Natively CPUID denies none of the ISA flags /proc/cpuinfo lists; under an emulator
    (tests/worker/test_emulated_cpu.py) it denies those above the emulated CPU, and the probe drops them."""
    _, flags = read_cpuinfo()
    assert probe().flags <= flags - cpuid_denied()


def test_the_probe_finds_the_emulated_cpu_it_runs_on() -> None:
    expected = os.environ.get("TIERSERVE_EXPECT_CPU_LEVEL")
    if not expected:
        pytest.skip("runs under an emulated CPU (tests/worker/test_emulated_cpu.py), which sets the level")
    assert probe().native_level is parse_level(expected), probe().describe()


def test_a_bad_override_names_the_variable_and_the_choices() -> None:
    with pytest.raises(CpuIsaError, match=f"{OVERRIDE_ENV}: expected one of default, avx2, avx512"):
        caps_from_flags(AVX2, override="sse9")


def test_export_caps_aten_onednn_and_mkl_without_overriding_what_is_set() -> None:
    env = {OVERRIDE_ENV: "avx2"}
    export_isa_env(env)
    assert env == {
        OVERRIDE_ENV: "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    env = {OVERRIDE_ENV: "avx512_bf16", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    export_isa_env(env)
    assert env["ATEN_CPU_CAPABILITY"] == "avx512" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert "MKL_ENABLE_INSTRUCTIONS" not in env  # at AVX-512 and above MKL keeps its own choice
    env = {}
    export_isa_env(env)
    assert env == {}


def test_read_cpuinfo_takes_the_first_cpu(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"
    )
    assert read_cpuinfo(path) == ("AMD EPYC 7B12", frozenset({"fpu", "sse2", "avx", "avx2", "fma"}))
    assert read_cpuinfo(tmp_path / "missing")[1] == frozenset()


def test_read_cpuinfo_names_the_family_and_model(tmp_path: Path) -> None:
    """A VM's "AMD EPYC" is a Zen 2, 4 or 5: the numbers tell them apart in logs and recorded figures."""
    path = tmp_path / "cpuinfo"
    path.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC\nflags\t\t: fpu avx2\n\n"
        "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: fpu\n"
    )
    assert read_cpuinfo(path) == ("AMD EPYC (family 25, model 17)", frozenset({"fpu", "avx2"}))


def test_level_needs_every_defining_flag() -> None:
    assert level_of({"avx2"}) is IsaLevel.DEFAULT  # AVX2 without FMA: no x86-64-v3
    assert level_of(AVX2 | {"avx512_bf16"}) is IsaLevel.AVX2  # bf16 without the AVX-512 core
    assert level_of(AVX512 | {"amx_bf16", "amx_tile"}) is IsaLevel.AVX512  # AMX without avx512_bf16


@pytest.mark.isa
def test_this_process_follows_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe of this very process: under TIERSERVE_CPU_ISA=avx2 (make test's second pass) it says
    avx2, and torch's oneDNN agrees that its bf16 path cannot run (export_isa_env ran in conftest)."""
    caps = probe()
    assert caps.level <= caps.native_level
    if caps.level <= IsaLevel.AVX2 and caps.is_overridden:
        assert not caps.onednn_bf16, "ONEDNN_MAX_CPU_ISA was not exported before torch started"
    monkeypatch.setenv(OVERRIDE_ENV, "default")
    probe.cache_clear()
    try:
        assert probe().level is IsaLevel.DEFAULT
    finally:
        monkeypatch.undo()
        probe.cache_clear()


def test_the_override_is_not_mistaken_for_a_config_key() -> None:
    from wire.config import NON_CONFIG_ENV_VARS

    assert OVERRIDE_ENV in NON_CONFIG_ENV_VARS
