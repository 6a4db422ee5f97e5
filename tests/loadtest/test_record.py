"""``--record``: only the scenario's block between its markers changes; hand-written text stays."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from loadtest.record import recorded_block, rewrite_section, topology

DOC = """# Benchmarks

Intro prose.

## engine — ours vs HF

Hand-written engine prose.

| a | b |
|---|---|

## gateway-overhead — the stack

Gateway prose.
"""


def block(value: int) -> str:
    return recorded_block(
        {"figure": value, "nested": {"x": [1, 2]}}, datetime(2026, 1, 2, 3, 4, tzinfo=UTC), "box"
    )


def test_first_record_goes_at_the_end_of_its_section() -> None:
    out = rewrite_section(DOC, "engine", block(1))
    engine, gateway = out.split("## gateway-overhead")
    assert "Hand-written engine prose." in engine and "| a | b |" in engine
    assert engine.rstrip().endswith("<!-- bench:engine:end -->")
    assert '"figure": 1' in engine
    assert gateway == DOC.split("## gateway-overhead")[1]  # the next section untouched
    assert out.startswith("# Benchmarks\n\nIntro prose.\n")


def test_rerecording_replaces_only_the_block() -> None:
    once = rewrite_section(DOC, "engine", block(1))
    twice = rewrite_section(once, "engine", block(2))
    assert '"figure": 1' not in twice and '"figure": 2' in twice
    assert twice.count("<!-- bench:engine:begin -->") == 1
    assert twice == once.replace('"figure": 1', '"figure": 2')


def test_a_scenario_without_a_section_gets_one_at_the_end() -> None:
    out = rewrite_section(DOC, "load-smoke", block(3))
    assert out.startswith(DOC.rstrip("\n"))
    assert out.endswith(
        "## load-smoke\n\n<!-- bench:load-smoke:begin -->\n" + block(3) + "\n<!-- bench:load-smoke:end -->\n"
    )
    # A heading that only starts with the name is another scenario's.
    assert rewrite_section("## engine-x\n\ntext\n", "engine", "B").endswith(
        "## engine\n\n<!-- bench:engine:begin -->\nB\n<!-- bench:engine:end -->\n"
    )


def test_a_variant_goes_into_the_section_of_its_longest_prefix() -> None:
    out = rewrite_section(DOC, "engine-fp32-avx2", block(4))
    engine, gateway = out.split("## gateway-overhead")
    assert engine.rstrip().endswith("<!-- bench:engine-fp32-avx2:end -->")
    assert gateway == DOC.split("## gateway-overhead")[1]
    # The longest prefix with a section wins.
    nested = rewrite_section(DOC + "\n## engine-fp32 — float32\n\nprose\n", "engine-fp32-avx2", "B")
    assert nested.endswith(
        "prose\n\n<!-- bench:engine-fp32-avx2:begin -->\nB\n<!-- bench:engine-fp32-avx2:end -->\n"
    )


def test_the_block_holds_date_machine_and_parseable_json() -> None:
    text = block(5)
    assert text.startswith("### Recorded 2026-01-02 03:04 UTC on box")
    payload = text.split("```json\n", 1)[1].split("```", 1)[0]
    assert json.loads(payload) == {"figure": 5, "nested": {"x": [1, 2]}}


def test_broken_markers_are_refused() -> None:
    with pytest.raises(ValueError, match="expected one"):
        rewrite_section(DOC + "<!-- bench:engine:begin -->\n", "engine", "B")
    with pytest.raises(ValueError, match="before"):
        rewrite_section("<!-- bench:engine:end -->\n<!-- bench:engine:begin -->\n", "engine", "B")


def _sysfs(root: Path, siblings: str | None, l3: str | None) -> Path:
    if siblings is not None:
        (root / "cpu0/topology").mkdir(parents=True)
        (root / "cpu0/topology/thread_siblings_list").write_text(siblings + "\n")
    if l3 is not None:
        (root / "cpu0/cache/index3").mkdir(parents=True)
        (root / "cpu0/cache/index3/size").write_text(l3 + "\n")
    return root


@pytest.mark.parametrize(
    ("siblings", "l3", "said"),
    [
        ("0", "32768K", "1 thread a core, L3 32 MiB"),
        ("0-1", "16384K", "2 threads a core, L3 16 MiB"),  # two logical CPUs on one core (SMT)
        ("0,2", "1536K", "2 threads a core, L3 1536 KiB"),
        ("0", None, "1 thread a core"),
        (None, "32768K", "L3 32 MiB"),
        (None, None, ""),
        ("garbage", "lots", ""),
    ],
)
def test_the_machine_line_says_threads_a_core_and_l3(
    tmp_path: Path, siblings: str | None, l3: str | None, said: str
) -> None:
    assert topology(_sysfs(tmp_path, siblings, l3)) == said
