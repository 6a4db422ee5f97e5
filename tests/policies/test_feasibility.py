"""A tier is feasible when the measured floor (one decode, one 512-token prefill, alone) meets it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from policies.feasibility import FEASIBILITY_PROMPT_TOKENS, StepFloor, assess, read_floor, save_floor
from wire.tier import DEFAULT_TIERS, Tier

INTERACTIVE, STANDARD, BATCH = DEFAULT_TIERS  # 1 s / 100 ms, 3 s / 200 ms, none


def test_a_floor_under_every_target_is_feasible_and_over_one_is_not() -> None:
    fast = StepFloor(decode_ms=6.0, prefill_ms_per_token=1.0)  # 512-token TTFT: 512 ms
    assert [v.is_feasible for v in assess(DEFAULT_TIERS, fast)] == [True, True, True]
    slow = StepFloor(decode_ms=150.0, prefill_ms_per_token=3.0)  # TTFT 1536 ms, TPOT 150 ms
    verdicts = {v.tier.name: v for v in assess(DEFAULT_TIERS, slow)}
    assert not verdicts["interactive"].tpot_feasible and not verdicts["interactive"].ttft_feasible
    assert verdicts["standard"].is_feasible and verdicts["batch"].is_feasible  # no targets: always
    line = verdicts["interactive"].describe()
    assert "'interactive'" in line and "TPOT target 100 ms, floor 150.0 ms" in line
    assert f"TTFT target 1000 ms, floor 1536 ms (a {FEASIBILITY_PROMPT_TOKENS}-token prompt" in line
    assert line.endswith("NOT feasible on this hardware even alone")
    (batch,) = assess([BATCH], slow)
    assert batch.describe() == "tier 'batch': no targets: feasible"


def test_assess_goes_most_urgent_first() -> None:
    tiers = [Tier(name="b", rank=2), Tier(name="a", rank=0)]
    assert [v.tier.name for v in assess(tiers, StepFloor(1.0, 1.0))] == ["a", "b"]


def test_a_saved_floor_reads_back_and_a_missing_or_broken_one_is_none(tmp_path: Path) -> None:
    floor = StepFloor(decode_ms=6.25, prefill_ms_per_token=1.125)
    path = save_floor(tmp_path, "org/model:v1", floor, "AMD EPYC")
    assert path.parent == tmp_path and "/" not in path.name
    found = read_floor(tmp_path, "org/model:v1")
    assert found is not None
    assert found[0] == floor and found[1].startswith("on AMD EPYC, ")
    assert read_floor(tmp_path, "other") is None
    path.write_text("{not json")
    assert read_floor(tmp_path, "org/model:v1") is None


def test_workers_of_one_model_saving_at_once_all_succeed(tmp_path: Path) -> None:
    """serve starts a pool's workers together; each saves its floor (this raced once: a shared
    temporary name made one worker's rename fail, and that worker did not start)."""
    floors = [StepFloor(5.0 + i, 0.02) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda f: save_floor(tmp_path, "mock", f, "cpu"), floors))
    assert len(set(paths)) == 1 and read_floor(tmp_path, "mock") is not None
    assert [p.name for p in tmp_path.iterdir()] == ["mock.json"]  # no temporary file left behind
