"""Logging a repeated event without flooding the log: its first occurrence, then every Nth."""

from __future__ import annotations


def is_logged(count: int, every: int) -> bool:
    """Whether occurrence number ``count`` (counted from 1) of a repeated event is logged: the first,
    then every ``every``-th, so the log shows both that it started and that it goes on."""
    return count == 1 or count % every == 0
