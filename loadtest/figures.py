"""How the benchmarks round and print their figures: one rule for every scenario's JSON and progress."""

from __future__ import annotations


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours ÷ theirs to 3 digits; None when either is missing (or theirs is zero)."""
    return None if ours is None or not theirs else round(ours / theirs, 3)


def fmt(value: float | None) -> str:
    """A figure for a progress line: one decimal, or n/a."""
    return "n/a" if value is None else f"{value:.1f}"
