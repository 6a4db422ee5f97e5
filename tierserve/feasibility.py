"""The step floors workers measured on this machine (worker/calibrate.py), read back for
``tierserve config show``: one comment per tier saying whether each served model can meet it."""

from __future__ import annotations

from pathlib import Path

from policies.feasibility import assess, read_floor
from wire.config import ServerConfig


def tier_notes(config: ServerConfig, folder: Path | None = None) -> dict[str, tuple[str, ...]]:
    """``{"tiers.<name>": comment lines}`` for every tier, from each primary pool's measured floor."""
    from worker.models.store import step_floors_dir  # lazy: it brings torch

    notes: dict[str, list[str]] = {f"tiers.{t.name}": [] for t in config.tiers}
    for pool in config.models.pools:
        if pool.role != "primary":
            continue
        found = read_floor(folder or step_floors_dir(), pool.model_name)
        for tier in config.tiers:
            lines = notes[f"tiers.{tier.name}"]
            if found is None:
                lines.append(f"{pool.model_name}: no step floor measured yet (a worker measures it at start)")
                continue
            floor, where = found
            (verdict,) = assess([tier], floor)
            lines.append(f"{pool.model_name} ({where}): {verdict.describe()}")
    return {key: tuple(lines) for key, lines in notes.items() if lines}
