"""examples/policy-plugin installed for real (pip --target, never into the project venv), then found,
refused and loaded through the registry in a fresh interpreter."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "policy-plugin"

CHECK = """
import json
from policies.registry import PolicyError, available, load_policy
from tierserve.testing import SimConfig, SimRequest, simulate
from wire.tier import DEFAULT_TIERS

out = {}
spec = available().get("ordering.short-first")
out["distribution"] = spec and spec.distribution
try:
    load_policy("ordering", "short-first")
except PolicyError as exc:
    out["refused"] = str(exc)
try:
    load_policy("ordering", "short-first", {"max_wait_s": -1}, allow_plugins=["ordering.short-first"])
except PolicyError as exc:
    out["bad_params"] = str(exc)
allow = ["ordering.short-first"]
policy = load_policy("ordering", "short-first", {"max_wait_s": "30"}, allow_plugins=allow)
out["class"] = f"{type(policy).__module__}.{type(policy).__qualname__}"
out["max_wait_s"] = policy.params.max_wait_s
standard = DEFAULT_TIERS[1]
requests = [SimRequest(f"long{i}", i * 0.01, standard, 1024, 8) for i in range(20)]
requests.append(SimRequest("short", 0.05, standard, 16, 8))
for name, ordering in (("short_first", policy), ("fcfs", load_policy("ordering", "fcfs"))):
    done = simulate(requests, ordering=ordering, config=SimConfig(max_num_seqs=1)).requests
    short = done["short"].finish_time
    out[f"{name}_long_done_first"] = sum(r.finish_time < short for i, r in done.items() if i != "short")
print(json.dumps(out))
"""


def install_example_plugin(work: Path) -> Path:
    """The example installed with the venv's pip into ``work/site`` (built from a copy, so the source
    tree gets no build/ or egg-info); put the returned folder on PYTHONPATH to use it."""
    source = work / "src"
    shutil.copytree(
        PLUGIN, source, ignore=shutil.ignore_patterns("tests", "__pycache__", "*.egg-info", "build")
    )
    target = work / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return target


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_example_plugin(tmp_path_factory.mktemp("plugin"))


def test_the_installed_plugin_is_found_refused_until_allowed_then_used(plugin_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, cwd=plugin_dir, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["distribution"] == "tierserve-policy-plugin"
    assert out["refused"] == (
        "policies.ordering: 'ordering.short-first' is a plugin from the package 'tierserve-policy-plugin'; "
        "list it in policies.allow_plugins to load it"
    )
    assert out["bad_params"].startswith(
        "policies.ordering.params: invalid parameters for 'ordering.short-first'"
    )
    assert "max_wait_s" in out["bad_params"]
    assert out["class"] == "tierserve_short_first.ordering.ShortFirst"
    assert out["max_wait_s"] == 30.0  # a TOML-ish string, converted
    # One sequence at a time behind a queue of long prompts: short-first takes the short one next.
    assert out["short_first_long_done_first"] <= 1 < out["fcfs_long_done_first"]


def test_the_project_venv_does_not_have_the_plugin() -> None:
    from policies.registry import available

    assert "ordering.short-first" not in available()
