"""Build a kernel's C source into a shared library once, cached by what went into it.

The library lands in ``cache_dir`` under a name hashed from the source (and the local files it
``#include``s), the compiler's version and the flags, so a second start loads it without compiling,
and a changed source or compiler builds anew. No ``-march`` flag: a source either gives each function
its own ISA target (the caller picks one by the CPU probe: one library serves every CPU), or is built
once per ISA with that ISA's ``ISA_FLAGS`` (one library each; the caller loads the one it may run).
OpenMP comes from the libgomp torch has already loaded (same soname), so kernels share torch's threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# -fno-trapping-math: branch-free clamps and selects vectorise (the kernels never read FP exceptions).
CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-fno-math-errno", "-fno-trapping-math")
ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"),
    "avx2": ("-mavx2", "-mfma"),
    "avx512_bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"),
    "avx512_vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma"),
}
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
BUILD_TIMEOUT_S = 120


class KernelBuildError(RuntimeError):
    """No C compiler, or it failed: the caller falls back to the torch path."""


def compiler() -> str:
    name = os.environ.get("CC", "cc")
    path = shutil.which(name)
    if path is None:
        raise KernelBuildError(f"no C compiler ({name!r} is not on PATH; set CC)")
    return path


def _texts(source: Path) -> list[str]:
    """The source and, recursively, the local files it includes (each once)."""
    seen: dict[Path, str] = {}
    todo = [source]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen[path] = path.read_text()
            todo.extend(path.parent / name for name in _INCLUDE.findall(seen[path]))
    return [seen[p] for p in sorted(seen)]


def load_library(source: Path, cache_dir: Path, isa: str | None = None) -> ctypes.CDLL:
    """``source`` built (or found built) in ``cache_dir``, loaded; ``isa``: built with its ISA_FLAGS."""
    cc = compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{cc} --version failed: {exc}") from None
    flags = (*CFLAGS, *(ISA_FLAGS[isa] if isa else ()))
    key = hashlib.sha256("\0".join([*_texts(source), version, *flags]).encode()).hexdigest()[:16]
    target = cache_dir / f"{source.stem}{'-' + isa if isa else ''}-{key}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        log.info("compiling %s with %s into %s", source.name, Path(cc).name, target)
        with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
            built = Path(scratch) / target.name
            try:
                done = subprocess.run(
                    [cc, *flags, str(source), "-o", str(built)],
                    capture_output=True,
                    text=True,
                    timeout=BUILD_TIMEOUT_S,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                raise KernelBuildError(f"{cc} failed on {source.name}: {exc}") from None
            if done.returncode != 0:
                raise KernelBuildError(f"{cc} failed on {source.name}: {done.stderr.strip()[-2000:]}")
            os.replace(built, target)  # atomic: two workers building at once both end with a whole file
    return ctypes.CDLL(str(target))
