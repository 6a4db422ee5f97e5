"""The ``peers`` bench's other servers held to tierserve's ISA level: an AVX2 stand-in on a bigger CPU.

Under ``TIERSERVE_CPU_ISA`` tierserve treats the CPU as that level; a comparison is fair only when the
peers are held to it too (before this, vLLM ran its AVX-512-BF16 kernels beside our AVX2 ones):

- vLLM-CPU picks its kernel library (``_C``, ``_C_AVX512``, ``_C_AVX2``), its attention path and
  inductor's vector ISA from torch's CPU probes (``torch.cpu._is_avx512_supported`` and the others):
  a ``sitecustomize.py`` on its PYTHONPATH makes those above the level answer False, in the API
  server and in the engine process it spawns; ATen, oneDNN and MKL read their own caps
  (``worker.cpu_isa.library_isa_env``). Which library it then loaded is read back from its
  processes' memory maps (``vllm_kernels``), so the figures say what ran.
- llama.cpp's native build chooses its code paths at compile time: a build variant without the
  extensions above the level (``peers_install.LLAMACPP_VARIANTS``).

Neither peer has code below AVX2: a ``default`` run holds them to AVX2.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from worker.cpu_isa import CpuCaps, IsaLevel, library_isa_env

# torch's CPU probes and the level each needs (ours: vnni is AVX512-VNNI, amx_fp16 comes with AMX).
TORCH_PROBES: dict[str, IsaLevel] = {
    "_is_avx512_supported": IsaLevel.AVX512,
    "_is_vnni_supported": IsaLevel.AVX512,
    "_is_avx512_bf16_supported": IsaLevel.AVX512_BF16,
    "_is_amx_tile_supported": IsaLevel.AMX,
    "_is_amx_fp16_supported": IsaLevel.AMX,
}
LLAMACPP_VARIANT: dict[IsaLevel, str] = {
    IsaLevel.AVX2: "avx2",
    IsaLevel.AVX512: "avx512",
    IsaLevel.AVX512_BF16: "noamx",
    IsaLevel.AMX: "native",
}
_VLLM_LIBRARY = re.compile(r"/vllm/(_C\w*)\.abi3\.so$")
SHIM = '''"""Written by tierserve's bench peers (loadtest/peers_isa.py) for a run held to {level}: torch's
CPU probes above that level answer False in every process started with this folder on PYTHONPATH."""

import torch.cpu

for _name in {names!r}:
    setattr(torch.cpu, _name, lambda: False)
'''


def peer_level(caps: CpuCaps) -> IsaLevel | None:
    """The level the peers are held to: tierserve's under TIERSERVE_CPU_ISA (AVX2 at least), or None
    where that is the CPU's own (the peers then use the whole CPU, as without the override)."""
    level = max(caps.level, IsaLevel.AVX2)
    return level if level < caps.native_level else None


def capped_probes(level: IsaLevel) -> list[str]:
    return [name for name, needs in TORCH_PROBES.items() if needs > level]


def vllm_env(level: IsaLevel, root: Path) -> dict[str, str]:
    """The environment that holds vLLM-CPU to ``level``; writes its ``sitecustomize.py`` under
    ``root`` (a folder of its own per level)."""
    shim = root / "isa-shims" / level.label
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(SHIM.format(level=level.label, names=capped_probes(level)))
    return {"PYTHONPATH": str(shim), **library_isa_env(level)}


def vllm_kernels(session: int, proc: Path = Path("/proc")) -> list[str]:
    """The vLLM kernel libraries (``_C``, ``_C_AVX2``, ...) mapped by the processes of ``session``
    (the server's process group leader: the API server and the engine process it spawned)."""
    found: set[str] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != session:
                continue
            maps = (entry / "maps").read_text()
        except OSError:  # gone, or not ours to read
            continue
        for line in maps.splitlines():
            match = _VLLM_LIBRARY.search(line)
            if match:
                found.add(match.group(1))
    return sorted(found)
