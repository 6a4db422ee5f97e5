"""Can this machine meet a tier's targets at all? The measured floor of a worker against each tier.

A worker measures, once at start (worker/calibrate.py), the step of one short decode alone and a
prefill of ``FEASIBILITY_PROMPT_TOKENS`` alone. A tier is feasible when its TPOT target is at least
that decode step and its TTFT target at least that prefill: anything slower than the floor cannot
be met even with the machine to itself, whatever the policies do. The gateway logs and exports the
verdict (``tierserve_tier_slo_feasible``), ``tierserve config show`` prints it; the slo-budget keeps
such a tier on the shortest steps it allows rather than starving the rest. Pure Python.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from wire.tier import Tier

FEASIBILITY_PROMPT_TOKENS = 512


@dataclass(frozen=True, slots=True)
class StepFloor:
    """What one worker measured alone: a one-decode step, and a prefill per prompt token."""

    decode_ms: float
    prefill_ms_per_token: float

    @property
    def ttft_ms(self) -> float:
        """The first token of a ``FEASIBILITY_PROMPT_TOKENS`` prompt with the machine to itself."""
        return self.prefill_ms_per_token * FEASIBILITY_PROMPT_TOKENS


@dataclass(frozen=True, slots=True)
class TierFeasibility:
    tier: Tier
    floor: StepFloor

    @property
    def tpot_feasible(self) -> bool:
        return self.tier.tpot_ms is None or self.floor.decode_ms <= self.tier.tpot_ms

    @property
    def ttft_feasible(self) -> bool:
        return self.tier.ttft_ms is None or self.floor.ttft_ms <= self.tier.ttft_ms

    @property
    def is_feasible(self) -> bool:
        return self.tpot_feasible and self.ttft_feasible

    def describe(self) -> str:
        """One line naming the tier, each target and the measured floor."""
        tier, floor = self.tier, self.floor
        parts = []
        if tier.tpot_ms is not None:
            parts.append(
                f"TPOT target {tier.tpot_ms:g} ms, floor {floor.decode_ms:.1f} ms (one decode alone)"
            )
        if tier.ttft_ms is not None:
            parts.append(
                f"TTFT target {tier.ttft_ms:g} ms, floor {floor.ttft_ms:.0f} ms "
                f"(a {FEASIBILITY_PROMPT_TOKENS}-token prompt alone)"
            )
        verdict = "feasible" if self.is_feasible else "NOT feasible on this hardware even alone"
        return f"tier {tier.name!r}: {'; '.join(parts) or 'no targets'}: {verdict}"


def assess(tiers: Iterable[Tier], floor: StepFloor) -> list[TierFeasibility]:
    return [TierFeasibility(tier, floor) for tier in sorted(tiers, key=lambda t: t.rank)]


# ---------------------------------------------------------------- the record a worker leaves behind
# One JSON file per served model in a folder the caller names (``$TIERSERVE_CACHE/.step_floors``):
# written by the worker at start, read by ``tierserve config show``.


def save_floor(folder: Path, model: str, floor: StepFloor, device_name: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{_file_name(model)}.json"
    record = {
        "model": model,
        "device_name": device_name,
        "decode_ms": round(floor.decode_ms, 3),
        "prefill_ms_per_token": round(floor.prefill_ms_per_token, 4),
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    # Several workers of one model start together: each writes its own temporary file, and the
    # last rename wins (one shared temporary name let one worker's rename pull the file from
    # under another's, which then failed to start).
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(path)
    return path


def read_floor(folder: Path, model: str) -> tuple[StepFloor, str] | None:
    """The last floor saved for ``model`` and where and when it was measured; None if none was."""
    try:
        record = json.loads((folder / f"{_file_name(model)}.json").read_text())
        floor = StepFloor(float(record["decode_ms"]), float(record["prefill_ms_per_token"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return floor, f"on {record.get('device_name') or 'this machine'}, {record.get('measured_at', '?')}"


def _file_name(model: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
