"""``tierserve bench SCENARIO --record``: rewrite that scenario's recorded block in docs/benchmarks.md.

A recorded block sits between two markers and holds the date, the machine and the figures' JSON:

    <!-- bench:NAME:begin -->
    ### Recorded 2026-11-30 18:00 UTC on …
    ```json
    {…}
    ```
    <!-- bench:NAME:end -->

Only the text between the markers changes. The first time, the block goes at the end of the section
whose heading starts with ``## NAME`` (the prose written by hand above it stays), else of the section
of the longest of NAME's dash-separated prefixes that has one (``peers-fp32-float-avx2`` into ``##
peers``), or, when there is none, into a new section at the end of the file.
"""

from __future__ import annotations

import json
import os
import platform
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from worker.cpu_isa import OVERRIDE_ENV, CpuCaps, caps_from_flags, read_cpuinfo  # torch-free: /proc/cpuinfo

BEGIN = "<!-- bench:{name}:begin -->"
END = "<!-- bench:{name}:end -->"


def cpu_caps() -> CpuCaps:
    """The CPU as the engine's probe sees it, TIERSERVE_CPU_ISA included."""
    model_name, flags = read_cpuinfo()
    return caps_from_flags(flags, model_name, os.environ.get(OVERRIDE_ENV))


SYS_CPU = Path("/sys/devices/system/cpu")


def _cpu_list_len(text: str) -> int:
    """How many CPUs a sysfs list names (``0-1,4``: 3)."""
    count = 0
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


def topology(sys_cpu: Path = SYS_CPU) -> str:
    """Threads a core and the L3 of CPU 0, as sysfs says (``1 thread a core, L3 32 MiB``); what it
    cannot read is left out. Two logical CPUs on one core (SMT) run compute-bound steps at about one
    core's speed: a figure's machine line says which it had."""
    said = []
    try:
        threads = _cpu_list_len((sys_cpu / "cpu0/topology/thread_siblings_list").read_text())
        said.append(f"{threads} thread{'s' if threads > 1 else ''} a core")
    except (OSError, ValueError):
        pass
    try:
        size = (sys_cpu / "cpu0/cache/index3/size").read_text().strip()  # "32768K"
        kib = int(size.removesuffix("K"))
        said.append(f"L3 {kib // 1024} MiB" if kib % 1024 == 0 else f"L3 {kib} KiB")
    except (OSError, ValueError):
        pass
    return ", ".join(said)


def machine() -> str:
    """CPU model and ISA (as the engine's probe sees it, TIERSERVE_CPU_ISA included), cores (threads a
    core, L3), OS and Python: figures differ by machine, so every recorded one says where it came from."""
    cpu = cpu_caps().describe()
    system = f"{platform.system()} {platform.machine()}"
    shape = topology()
    cores = f"{os.cpu_count()} cores" + (f" ({shape})" if shape else "")
    return f"{cpu}; {cores}, {system}, Python {platform.python_version()}"


def recorded_block(figures: Mapping[str, object], when: datetime, where: str) -> str:
    stamp = when.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
    # A key per line, each value compact: short lines that diff well between recordings.
    body = ",\n".join(f" {json.dumps(key)}: {json.dumps(value)}" for key, value in figures.items())
    return f"### Recorded {stamp} on {where}\n\n```json\n{{\n{body}\n}}\n```"


def _section_heading(markdown: str, name: str) -> re.Match[str] | None:
    """The ``## `` heading of ``name``'s section, else of its longest dash-separated prefix's."""
    parts = name.split("-")
    for n in range(len(parts), 0, -1):
        prefix = re.escape("-".join(parts[:n]))
        heading = re.search(rf"^## {prefix}(?=\s|$).*$", markdown, flags=re.MULTILINE)
        if heading is not None:
            return heading
    return None


def rewrite_section(markdown: str, name: str, block: str) -> str:
    """``markdown`` with scenario ``name``'s recorded block replaced by (or given) ``block``."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    num_begin, num_end = markdown.count(begin), markdown.count(end)
    fenced = f"{begin}\n{block.strip()}\n{end}"
    if (num_begin, num_end) == (1, 1):
        start, stop = markdown.index(begin), markdown.index(end)
        if stop < start:
            raise ValueError(f"{end!r} comes before {begin!r}")
        return markdown[:start] + fenced + markdown[stop + len(end) :]
    if num_begin or num_end:
        raise ValueError(f"expected one {begin!r} and one {end!r}, found {num_begin} and {num_end}")
    heading = _section_heading(markdown, name)
    if heading is None:
        return markdown.rstrip("\n") + f"\n\n## {name}\n\n{fenced}\n"
    following = re.search(r"^## ", markdown[heading.end() :], flags=re.MULTILINE)
    stop = heading.end() + following.start() if following else len(markdown)
    section = markdown[:stop].rstrip("\n")
    rest = markdown[stop:]
    return f"{section}\n\n{fenced}\n" + (f"\n{rest}" if rest else "")
