import sys
from pathlib import Path

from loadtest.machine_state import CpuTimes, cpu_times, read_gb_s, steal_pct

STAT = "cpu  {user} 0 {system} {idle} 0 0 0 {steal} {guest} 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1\n"


def write(path: Path, user: int, system: int, idle: int, steal: int, guest: int = 0) -> Path:
    path.write_text(STAT.format(user=user, system=system, idle=idle, steal=steal, guest=guest))
    return path


def test_the_machines_line_is_read_without_guest_time(tmp_path: Path) -> None:
    # guest time is in user already: counting it again would understate the steal share
    assert cpu_times(write(tmp_path / "stat", 100, 50, 800, 50, guest=40)) == CpuTimes(1000, 50)


def test_steal_is_a_share_of_the_time_between_readings(tmp_path: Path) -> None:
    before = cpu_times(write(tmp_path / "a", 100, 50, 800, 50))
    after = cpu_times(write(tmp_path / "b", 400, 150, 1300, 150))  # 1000 more jiffies, 100 stolen
    assert steal_pct(before, after) == 10.0
    assert steal_pct(after, after) is None  # no time passed
    assert steal_pct(None, after) is None and steal_pct(before, None) is None


def test_no_reading_where_the_file_is_missing_or_has_no_steal(tmp_path: Path) -> None:
    assert cpu_times(tmp_path / "absent") is None
    (tmp_path / "old").write_text("cpu  1 2 3 4 5\n")
    assert cpu_times(tmp_path / "old") is None


def test_this_machine_reads() -> None:
    times = cpu_times()
    if sys.platform == "linux":
        assert times is not None and 0 <= times.steal < times.total


def test_the_read_bandwidth_is_measured() -> None:
    assert read_gb_s(16 * 1024**2, passes=3) > 0
