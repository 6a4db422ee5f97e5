"""What this CPU can compute, asked once: the capability probe every CPU-specific path checks.

The facts are the ones PyTorch and oneDNN act on: the CPU's flags (``/proc/cpuinfo``), held to what
CPUID says this process can execute (torch's cpuinfo: the instruction set and the registers the OS
saves; an emulator or a masking hypervisor can list more in ``/proc/cpuinfo`` than runs, and a kernel
chosen from those flags dies of SIGILL), ATen's kernel level
(``torch.backends.cpu.get_cpu_capability``) and oneDNN's own answer on its bf16 path
(``torch.ops.mkldnn._is_mkldnn_bf16_supported``; the pre-packed bf16 linears raise where it is False).

``TIERSERVE_CPU_ISA`` (``default``, ``avx2``, ``avx512``, ``avx512_bf16``, ``amx``) makes the process
behave as on a CPU of that level: the probe drops the flags above it, and :func:`export_isa_env` caps
ATen, oneDNN and MKL to the same level (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``), which each read once, so it must run before torch computes anything.
An override can only lower the level: asking for more than the CPU has keeps the CPU's own, with a
warning. The ``peers`` bench holds the servers it compares with to the same level
(``loadtest/peers_isa.py``)."""

from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

log = logging.getLogger(__name__)

OVERRIDE_ENV = "TIERSERVE_CPU_ISA"
AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})


class IsaLevel(IntEnum):
    """x86-64 levels as the engine sees them, each a superset of the one below."""

    DEFAULT = 0  # SSE only (or not x86): plain kernels
    AVX2 = 1  # AVX2 + FMA: bf16 only by conversion
    AVX512 = 2  # AVX-512 F/BW/VL/DQ: oneDNN's bf16 path runs, still by conversion
    AVX512_BF16 = 3  # native bf16 dot products (vdpbf16ps)
    AMX = 4  # AMX tiles with bf16

    @property
    def label(self) -> str:
        return self.name.lower()


# The flags each level adds; a level holds its own and every lower level's.
_LEVEL_FLAGS: dict[IsaLevel, frozenset[str]] = {
    IsaLevel.AVX2: frozenset({"avx", "avx2", "fma", "f16c", "avx_vnni", "avx_ne_convert"}),
    IsaLevel.AVX512: frozenset(
        {"avx512cd", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bitalg"}
        | {"avx512_vpopcntdq", "avx512_fp16", "avx512_vp2intersect"}
        | AVX512_CORE
    ),
    IsaLevel.AVX512_BF16: frozenset({"avx512_bf16"}),
    IsaLevel.AMX: frozenset({"amx_bf16", "amx_tile", "amx_int8", "amx_fp16", "amx_complex"}),
}
# What ATen, oneDNN and MKL are capped to for each level (their own spellings).
_ATEN_CAPABILITY = {IsaLevel.DEFAULT: "default", IsaLevel.AVX2: "avx2"}  # higher levels: avx512
_MKL_INSTRUCTIONS = {IsaLevel.DEFAULT: "SSE4_2", IsaLevel.AVX2: "AVX2"}  # higher levels: MKL's own choice
_ONEDNN_MAX_ISA = {
    IsaLevel.DEFAULT: "SSE41",
    IsaLevel.AVX2: "AVX2",
    IsaLevel.AVX512: "AVX512_CORE",
    IsaLevel.AVX512_BF16: "AVX512_CORE_BF16",
    IsaLevel.AMX: "AVX512_CORE_AMX",
}


class CpuIsaError(ValueError):
    """TIERSERVE_CPU_ISA names no level."""


@dataclass(frozen=True, slots=True)
class CpuCaps:
    """The CPU as the engine may use it: its own level, and the level it is treated as."""

    model_name: str
    native_level: IsaLevel  # what the CPU offers
    level: IsaLevel  # what the engine uses (lower under TIERSERVE_CPU_ISA)
    flags: frozenset[str]  # the ISA flags of ``level`` that the CPU has
    onednn_bf16: bool = True  # oneDNN's own answer (False where torch says its bf16 path cannot run)

    @property
    def is_overridden(self) -> bool:
        return self.level != self.native_level

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware: bf16 is then faster than float32; elsewhere it converts."""
        return self.level >= IsaLevel.AVX512_BF16

    @property
    def can_pack_bf16(self) -> bool:
        """oneDNN's bf16 linear path (the pre-packed weights) runs: AVX-512 core or AVX-NE-CONVERT."""
        has_path = self.flags >= AVX512_CORE or "avx_ne_convert" in self.flags
        return has_path and self.onednn_bf16

    def describe(self) -> str:
        shown = sorted(f for f in self.flags if f.startswith(("avx512", "amx", "avx_ne")))
        level = self.level.label
        if self.is_overridden:
            level += f" ({OVERRIDE_ENV}; the CPU has {self.native_level.label})"
        return f"{self.model_name}: {level}" + (f", flags {' '.join(shown)}" if shown else "")


def parse_level(text: str) -> IsaLevel:
    try:
        return IsaLevel[text.strip().upper()]
    except KeyError:
        names = ", ".join(level.label for level in IsaLevel)
        raise CpuIsaError(f"{OVERRIDE_ENV}: expected one of {names}, got {text!r}") from None


def level_of(flags: Iterable[str]) -> IsaLevel:
    """The highest level whose defining flags are all present."""
    have = set(flags)
    if {"amx_bf16", "amx_tile", "avx512_bf16"} <= have and have >= AVX512_CORE:
        return IsaLevel.AMX
    if "avx512_bf16" in have and have >= AVX512_CORE:
        return IsaLevel.AVX512_BF16
    if have >= AVX512_CORE and {"avx2", "fma"} <= have:
        return IsaLevel.AVX512
    if {"avx2", "fma"} <= have:
        return IsaLevel.AVX2
    return IsaLevel.DEFAULT


def caps_from_flags(
    flags: Iterable[str],
    model_name: str = "unknown CPU",
    override: str | None = None,
    onednn_bf16: bool = True,
    denied: Iterable[str] = (),
) -> CpuCaps:
    """The decisions for a CPU with these flags (pure: the probe's tests feed it each CPU kind).
    ``denied``: flags CPUID denies (:func:`cpuid_denied`), dropped whatever ``flags`` lists."""
    have = frozenset(flags) - frozenset(denied)
    native = level_of(have)
    level = native
    if override:
        wanted = parse_level(override)
        if wanted > native:
            log.warning(
                "%s=%s asks for more than this CPU offers (%s); using %s",
                OVERRIDE_ENV,
                override,
                native.label,
                native.label,
            )
        level = min(wanted, native)
    allowed = frozenset().union(*(_LEVEL_FLAGS[lv] for lv in IsaLevel if lv <= level and lv in _LEVEL_FLAGS))
    return CpuCaps(model_name, native, level, have & allowed, onednn_bf16)


# The ISA flags the levels are made of, and the ones torch's cpuinfo spells otherwise.
ISA_FLAGS = frozenset().union(*_LEVEL_FLAGS.values())
_CPUINFO_NAMES = {"fma": "fma3"} | {
    f: "avx512_" + f.removeprefix("avx512") for f in ISA_FLAGS if f.startswith("avx512") and "_" not in f
}


def cpuid_denied() -> frozenset[str]:
    """The ISA flags this process cannot execute although ``/proc/cpuinfo`` may list them: those that
    CPUID and the OS's saved registers (XCR0) deny, as torch's cpuinfo reads them
    (``torch.cpu.get_capabilities``). Empty where this torch cannot say.

    ``/proc/cpuinfo`` is the host's under a user-mode emulator (``qemu-x86_64 -cpu Haswell`` on an
    AVX-512 host lists AVX-512 and executes none of it); ATen's own dispatch follows CPUID, and so
    must the engine's kernels. A flag cpuinfo does not know is not denied."""
    import torch

    get = getattr(torch.cpu, "get_capabilities", None)
    if get is None:
        return frozenset()
    found = get()
    return frozenset(f for f in ISA_FLAGS if found.get(_CPUINFO_NAMES.get(f, f)) is False)


def library_isa_env(level: IsaLevel) -> dict[str, str]:
    """The variables that hold ATen, oneDNN and MKL (PyTorch's BLAS) to ``level``: each library reads
    its own once, at its first kernel, in whichever process it runs (ours, or a peer's under the
    ``peers`` bench)."""
    env = {
        "ATEN_CPU_CAPABILITY": _ATEN_CAPABILITY.get(level, "avx512"),
        "ONEDNN_MAX_CPU_ISA": _ONEDNN_MAX_ISA[level],
    }
    if level in _MKL_INSTRUCTIONS:
        env["MKL_ENABLE_INSTRUCTIONS"] = _MKL_INSTRUCTIONS[level]
    return env


def export_isa_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Under TIERSERVE_CPU_ISA, cap ATen's, oneDNN's and MKL's own dispatch to that level (a variable
    already set is left as it is).

    Each reads its variable once, at its first kernel: call this before torch computes anything
    (the worker command line and the test suite do it first thing). Child processes inherit it.
    """
    text = environ.get(OVERRIDE_ENV)
    if not text:
        return
    for key, value in library_isa_env(parse_level(text)).items():
        environ.setdefault(key, value)


def read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU; empty flags where there is no such file (not Linux).

    The name carries the CPU's family and model numbers where the file gives them: a VM's name is often
    the vendor's line alone ("AMD EPYC" for a Zen 2, 4 or 5), and figures from one do not carry to another.
    """
    try:
        text = path.read_text()
    except OSError:
        return platform.processor() or platform.machine() or "unknown CPU", frozenset()
    first: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    model_name = first.get("model name") or "unknown CPU"
    if "cpu family" in first and "model" in first:
        model_name += f" (family {first['cpu family']}, model {first['model']})"
    return model_name, frozenset(first.get("flags", "").split())


@functools.cache
def probe() -> CpuCaps:
    """This process's CPU, read once and logged once."""
    model_name, flags = read_cpuinfo()
    onednn_bf16 = _torch_onednn_bf16()
    denied = cpuid_denied() & flags
    if denied:
        log.warning(
            "cpu: /proc/cpuinfo lists %s, which CPUID denies this process (an emulator, or a hypervisor "
            "that masks features): the engine goes without them",
            " ".join(sorted(denied)),
        )
    caps = caps_from_flags(flags, model_name, os.environ.get(OVERRIDE_ENV), onednn_bf16, denied)
    log.info("cpu: %s", caps.describe())
    _check_torch_agrees(caps)
    return caps


def _torch_onednn_bf16() -> bool:
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


def _check_torch_agrees(caps: CpuCaps) -> None:
    """An override set after torch's first kernel cannot lower ATen any more: say so once."""
    import torch

    aten = torch.backends.cpu.get_cpu_capability().lower()
    if caps.is_overridden and caps.level <= IsaLevel.AVX2 and aten.startswith("avx512"):
        log.warning(
            "%s=%s came after torch chose its %s kernels: the engine's own choices follow it, ATen's do not "
            "(set it before the process starts)",
            OVERRIDE_ENV,
            caps.level.label,
            aten,
        )
