"""Build a kernel's C source into a shared library once, cached by what went into it.

The library lands in ``cache_dir`` under a name hashed from the source, the compiler's version and the
flags, so a second start loads it without compiling, and a changed source or compiler builds anew.
No ``-march`` flag: each function carries its own ISA target, and the caller picks one by the CPU
probe, so one library serves every CPU a cache folder is shared with. OpenMP comes from the libgomp
torch has already loaded (same soname), so kernels share torch's threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-fno-math-errno")
BUILD_TIMEOUT_S = 120


class KernelBuildError(RuntimeError):
    """No C compiler, or it failed: the caller falls back to the torch path."""


def compiler() -> str:
    name = os.environ.get("CC", "cc")
    path = shutil.which(name)
    if path is None:
        raise KernelBuildError(f"no C compiler ({name!r} is not on PATH; set CC)")
    return path


def load_library(source: Path, cache_dir: Path) -> ctypes.CDLL:
    """``source`` built (or found built) in ``cache_dir``, loaded."""
    cc = compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{cc} --version failed: {exc}") from None
    key = hashlib.sha256("\0".join([source.read_text(), version, *CFLAGS]).encode()).hexdigest()[:16]
    target = cache_dir / f"{source.stem}-{key}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        log.info("compiling %s with %s into %s", source.name, Path(cc).name, target)
        with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
            built = Path(scratch) / target.name
            try:
                done = subprocess.run(
                    [cc, *CFLAGS, str(source), "-o", str(built)],
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
