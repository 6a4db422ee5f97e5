"""deploy/docker/*.Dockerfile install the project as the Makefile's bootstrap does (read, not built:
there is no Docker daemon here): the Makefile's torch pin first, then the project itself, not editable
and without the dev extras, every package of pyproject.toml copied in, the model pulled at build time
by the user the pods run as."""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("*.Dockerfile"))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    text: str


def instructions(path: Path) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped, ARG defaults
    substituted into what follows them."""
    lines: list[str] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    result = []
    for line in lines:
        keyword, _, text = line.strip().partition(" ")
        for name, value in args.items():
            text = re.sub(rf"\$\{{{name}\}}|\${name}\b", value, text)
        if keyword.upper() == "ARG" and "=" in text:
            name, _, value = text.partition("=")
            args[name.strip()] = value.strip()
        result.append(Instruction(keyword.upper(), text.strip()))
    return result


def makefile_torch_pin() -> str:
    match = re.search(r"^TORCH_CPU\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, "the Makefile no longer names TORCH_CPU"
    return match.group(1)


def pip_installs(steps: list[Instruction]) -> list[tuple[int, list[str]]]:
    """(index, arguments after 'pip install') of every pip install in a RUN."""
    found = []
    for i, step in enumerate(steps):
        if step.keyword != "RUN":
            continue
        for command in re.split(r"&&|;", step.text):
            words = shlex.split(command)
            if words[:2] == ["pip", "install"] or words[1:3] == ["-m", "pip"]:
                start = words.index("install") + 1
                found.append((i, words[start:]))
    return found


def index_of(steps: list[Instruction], keyword: str, contains: str) -> int:
    matches = [i for i, s in enumerate(steps) if s.keyword == keyword and contains in s.text]
    assert matches, f"no {keyword} containing {contains!r}"
    return matches[0]


@pytest.fixture(params=DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def dockerfile(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


def test_there_is_a_cpu_and_a_cuda_image() -> None:
    assert {p.name for p in DOCKERFILES} >= {"cpu.Dockerfile", "cuda.Dockerfile"}
    cuda = instructions(ROOT / "deploy" / "docker" / "cuda.Dockerfile")
    assert cuda[0].keyword == "FROM" and cuda[0].text.startswith("nvidia/cuda:"), "an NVIDIA base image"


def test_torch_is_the_makefiles_pin_installed_before_the_project(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    installs = pip_installs(steps)
    torch = [(i, args) for i, args in installs if any(a.startswith("torch") for a in args)]
    assert len(torch) == 1, f"{dockerfile.name}: torch installed {len(torch)} times"
    (at, args) = torch[0]
    assert makefile_torch_pin() in args, (
        f"{dockerfile.name}: {args} is not the Makefile's {makefile_torch_pin()}"
    )
    project = [i for i, a in installs if not any(x.startswith("torch") for x in a)]
    assert project and at < min(project), "torch first, or the project's torch>=2.5 picks another build"
    from_cpu_index = "--index-url" in args and args[args.index("--index-url") + 1] == CPU_INDEX
    assert from_cpu_index == (dockerfile.name == "cpu.Dockerfile"), "the CPU build on CPU, CUDA's on GPUs"


def test_the_project_is_installed_whole_not_editable_without_dev_extras(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copy_of_pyproject = next(s for s in steps if s.keyword == "COPY" and "pyproject.toml" in s.text)
    source = copy_of_pyproject.text.split()[-1].rstrip("/")
    assert pyproject["project"]["readme"] in copy_of_pyproject.text.split(), "setuptools reads the readme"
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    copied = {tuple(s.text.split()) for s in steps if s.keyword == "COPY"}
    for package in packages:
        assert (package, f"{source}/{package}") in copied, f"{dockerfile.name} does not copy {package}/"
    installs = [args for _, args in pip_installs(steps) if not any(a.startswith("torch") for a in args)]
    assert installs == [[source]], f"{dockerfile.name}: expected 'pip install {source}', got {installs}"

    ignored = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().split()
    assert "*" in ignored
    for package in [*packages, "pyproject.toml", pyproject["project"]["readme"]]:
        assert f"!{package}" in ignored, f"the build context leaves {package} out"


def test_the_model_is_pulled_at_build_time_by_the_pods_user(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    install = index_of(steps, "RUN", "pip install /")
    pull = index_of(steps, "RUN", "tierserve models pull")
    cache = index_of(steps, "ENV", "TIERSERVE_CACHE=")
    users = [i for i, s in enumerate(steps) if s.keyword == "USER"]
    assert cache < pull and install < pull and users and users[-1] < pull
    uid = steps[users[-1]].text
    pods = [
        doc["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
        for path in sorted((ROOT / "deploy" / "base").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] in ("StatefulSet", "Deployment")
    ]
    assert pods and {str(u) for u in pods} == {uid}, "the pods run as the user owning the model cache"
