"""``tierserve config show``: the effective configuration, every policy parameter, the tiers' feasibility."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from policies.feasibility import StepFloor, save_floor
from tierserve.config_show import render
from tierserve.feasibility import tier_notes
from wire.config import load_config


def test_show_prints_what_serve_would_load_with_every_policy_parameter(tmp_path: Path) -> None:
    config_file = tmp_path / "t.toml"
    config_file.write_text('[policies]\nbudget = { name = "slo-budget", params = { safety = 0.5 } }\n')
    shown = subprocess.run(
        [sys.executable, "-m", "tierserve", "config", "show", "--config", str(config_file)],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "TIERSERVE_CACHE": str(tmp_path / "cache")},
    ).stdout
    tree = tomllib.loads(shown)
    budget = tree["policies"]["budget"]
    assert budget["name"] == "slo-budget" and budget["params"]["safety"] == 0.5
    assert budget["params"]["min_step_factor"] == 2.0  # a default, filled in
    assert tree["policies"]["ordering"]["name"] == "tiered"  # tier-aware by default
    assert 'ordering = "fcfs", budget = "static"' in shown  # and the way back, in a comment
    assert "no step floor measured yet" in shown
    # service_tiers unset: the mapping it stands for, in a comment (loading the output keeps it unset).
    assert "priority -> interactive, default -> standard, flex -> batch" in shown
    assert "service_tiers" not in tree
    again = tmp_path / "again.toml"
    again.write_text(shown)
    # Loading what it printed gives the same configuration (its policy parameters now spelt out).
    assert render(load_config(again, env={})) == render(load_config(config_file, env={}))


def test_show_says_which_tiers_this_machine_can_meet(tmp_path: Path) -> None:
    config = load_config(None, env={})
    model = config.models.pools[0].model_name
    save_floor(tmp_path, model, StepFloor(decode_ms=150.0, prefill_ms_per_token=1.0), "Slow CPU")
    notes = tier_notes(config, tmp_path)
    assert "NOT feasible" in notes["tiers.interactive"][0] and "on Slow CPU" in notes["tiers.interactive"][0]
    assert notes["tiers.standard"][0].endswith(": feasible")
    # Comments sit above their tier: the interactive one's just before its [[tiers]], none elsewhere
    # (the floors given, not this machine's cache).
    before, first, *rest = render(config, floors=tmp_path).split("[[tiers]]")
    assert "NOT feasible" in before and 'name = "interactive"' in first
    assert not any("NOT feasible" in block for block in (first, *rest))


def test_a_service_tiers_table_is_shown_as_given() -> None:
    config = load_config(None, env={"TIERSERVE_SERVICE_TIERS__FLEX": "standard"})
    shown = render(config)
    assert tomllib.loads(shown)["service_tiers"] == {"flex": "standard"}
    assert "service_tiers unset" not in shown
