"""The liveness file (worker/liveness.py) and ``tierserve worker probe`` in-process; the probe against a
real worker and gateway is tests/deploy/test_worker_probe.py."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from worker import cli
from worker.liveness import LivenessFile, check


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def age_file(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_the_first_beat_creates_the_file(tmp_path: Path) -> None:
    path = tmp_path / "alive"
    liveness = LivenessFile(path)
    assert not path.exists()
    liveness.beat()
    assert check(path, max_age_s=5) is None


def test_a_file_from_an_earlier_run_is_removed_at_start(tmp_path: Path) -> None:
    path = tmp_path / "alive"
    path.touch()  # fresh, as a crashed container's would be a moment after the crash
    LivenessFile(path)
    assert not path.exists()
    assert "has not started" in (check(path, max_age_s=5) or "")


def test_beats_touch_at_most_once_per_interval(tmp_path: Path) -> None:
    path = tmp_path / "alive"
    clock = FakeClock()
    liveness = LivenessFile(path, min_interval_s=1.0, clock=clock)
    liveness.beat()
    age_file(path, 60)
    clock.now += 0.5
    liveness.beat()  # too soon: not touched
    assert "no progress for 60" in (check(path, max_age_s=30) or "")
    clock.now += 0.5
    liveness.beat()
    assert check(path, max_age_s=30) is None


def test_check_reports_the_age_of_a_stale_file(tmp_path: Path) -> None:
    path = tmp_path / "alive"
    path.touch()
    mtime = path.stat().st_mtime
    assert check(path, max_age_s=10, now=mtime + 9.5) is None
    problem = check(path, max_age_s=10, now=mtime + 12.0)
    assert problem is not None and "no progress for 12.0 s (more than 10 s)" in problem


def test_a_failed_touch_is_logged_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gone" / "alive"  # its folder does not exist
    clock = FakeClock()
    liveness = LivenessFile(path, min_interval_s=1.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="worker.liveness"):
        for _ in range(3):
            liveness.beat()
            clock.now += 2
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"cannot touch the liveness file {path}"
    ]
    assert "has not started" in (check(path, max_age_s=5) or "")


def test_probe_exit_codes_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "alive"
    argv = ["worker", "probe", "--liveness-file", str(path), "--max-age-s", "30"]
    assert cli.main(argv) == 1
    assert "unhealthy: no liveness file" in capsys.readouterr().out
    path.touch()
    assert cli.main(argv) == 0
    age_file(path, 45)
    assert cli.main(argv) == 1
    assert "unhealthy: no progress for 45" in capsys.readouterr().out


def test_probe_and_worker_flags_parse() -> None:
    probe = cli.parse_args(["worker", "probe", "--liveness-file", "/run/a", "--max-age-s", "60"])
    assert (probe.command, probe.liveness_file, probe.max_age_s) == ("probe", "/run/a", 60.0)
    worker = cli.parse_args(["worker", "--connect", "tcp://h:1", "--liveness-file", "/run/a"])
    assert (worker.command, worker.liveness_file) == ("worker", "/run/a")
    assert cli.parse_args(["worker", "--connect", "tcp://h:1"]).liveness_file is None
    for bad in (["--max-age-s", "0"], ["--max-age-s", "soon"], []):
        with pytest.raises(SystemExit):
            cli.parse_args(["worker", "probe", "--liveness-file", "/run/a", *bad])
