"""policies.registry: built-ins by name, and every way a selection can fail names policies.<kind>."""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import ClassVar

import pytest

from policies.base import NoParams
from policies.budget import SloBudget
from policies.eviction import PriorityWeighted
from policies.registry import BUILTIN_DISTRIBUTION, PolicyError, PolicySpec, available, load_policy

BUILTINS = {
    "ordering": ["fcfs", "tiered"],
    "budget": ["static", "slo-budget"],
    "preemption": ["newest", "lowest-tier"],
    "eviction": ["lru", "priority-weighted"],
}


def spec(key: str, value: str, distribution: str = "some-plugin") -> PolicySpec:
    kind, _, name = key.partition(".")
    return PolicySpec(kind, name, distribution, EntryPoint(key, value, "tierserve.policies"))


def registry(*specs: PolicySpec) -> dict[str, PolicySpec]:
    return {s.key: s for s in specs}


class NotAnOrdering:
    """Declares the ordering kind but has no ``order``."""

    kind: ClassVar[str] = "ordering"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        pass


class NoParamsStruct:
    kind: ClassVar[str] = "ordering"


class Picky:
    kind: ClassVar[str] = "ordering"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        raise ValueError("needs a tenant table")


@pytest.mark.parametrize(("kind", "name"), [(k, n) for k, names in BUILTINS.items() for n in names])
def test_every_builtin_is_registered_and_loads_by_name(kind: str, name: str) -> None:
    specs = available()
    assert specs[f"{kind}.{name}"].distribution == BUILTIN_DISTRIBUTION
    policy = load_policy(kind, name)  # type: ignore[arg-type]
    assert policy.kind == kind


def test_params_are_typed_and_lax_about_toml_string_keys() -> None:
    budget = load_policy("budget", "slo-budget", {"safety": 0.5, "min_step_factor": "4"})
    assert isinstance(budget, SloBudget)
    assert (budget.params.safety, budget.params.min_step_factor) == (0.5, 4.0)
    eviction = load_policy("eviction", "priority-weighted", {"weights": {"0": 8, "3": 0.5}})
    assert isinstance(eviction, PriorityWeighted) and eviction.weights == {0: 8.0, 3: 0.5}


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(
        PolicyError, match=r"^policies\.ordering: no ordering policy named 'fifo' \(known: fcfs, tiered"
    ):
        load_policy("ordering", "fifo")


def test_a_name_of_another_kind_is_unknown_for_this_kind() -> None:
    with pytest.raises(PolicyError, match=r"^policies\.budget: no budget policy named 'tiered'"):
        load_policy("budget", "tiered")


def test_an_entry_point_declaring_another_kind_is_refused() -> None:
    reg = registry(spec("ordering.static", "policies.budget:Static", BUILTIN_DISTRIBUTION))
    with pytest.raises(PolicyError, match=r"^policies\.ordering: 'ordering\.static' declares kind 'budget'"):
        load_policy("ordering", "static", registry=reg)


@pytest.mark.parametrize(
    ("kind", "name", "params", "message"),
    [
        ("budget", "slo-budget", {"safety": 2.0}, r"Expected `float` <= 1.0 - at `\$\.safety`"),
        ("budget", "slo-budget", {"min_step_factor": 0.5}, r"min_step_factor"),
        ("budget", "slo-budget", {"saftey": 0.5}, r"unknown field `saftey`"),
        ("ordering", "fcfs", {"anything": 1}, r"unknown field `anything`"),
        ("eviction", "priority-weighted", {"weights": {"0": -1}}, r"weights"),
    ],
)
def test_bad_params_name_the_params_key(
    kind: str, name: str, params: dict[str, object], message: str
) -> None:
    with pytest.raises(
        PolicyError, match=rf"^policies\.{kind}\.params: invalid parameters for '{kind}\.{name}'"
    ):
        load_policy(kind, name, params)  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match=message):
        load_policy(kind, name, params)  # type: ignore[arg-type]


def test_a_plugin_loads_only_when_allow_listed() -> None:
    reg = registry(spec("ordering.same-as-tiered", "policies.ordering:Tiered"))
    with pytest.raises(
        PolicyError,
        match=r"^policies\.ordering: 'ordering\.same-as-tiered' is a plugin from the package 'some-plugin'; "
        r"list it in policies\.allow_plugins",
    ):
        load_policy("ordering", "same-as-tiered", registry=reg)
    # Allowing another name, or the same name of another kind, is not enough.
    for allowed in (["ordering.other"], ["budget.same-as-tiered"]):
        with pytest.raises(PolicyError, match="allow_plugins"):
            load_policy("ordering", "same-as-tiered", allow_plugins=allowed, registry=reg)
    policy = load_policy(
        "ordering", "same-as-tiered", allow_plugins=["ordering.same-as-tiered"], registry=reg
    )
    assert policy.kind == "ordering"


def test_a_plugin_that_raises_at_import_is_named_with_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "exploding_plugin.py").write_text("raise RuntimeError('no GPU driver here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "exploding_plugin", raising=False)
    reg = registry(spec("ordering.boom", "exploding_plugin:Boom"))
    with pytest.raises(
        PolicyError,
        match=r"^policies\.ordering: plugin 'ordering\.boom' \(exploding_plugin:Boom\) failed to load: "
        r"RuntimeError: no GPU driver here",
    ):
        load_policy("ordering", "boom", allow_plugins=["ordering.boom"], registry=reg)


def test_a_plugin_whose_module_is_missing_is_named() -> None:
    reg = registry(spec("ordering.gone", "no_such_module_anywhere:Gone"))
    with pytest.raises(PolicyError, match=r"'ordering\.gone' .* failed to load: ModuleNotFoundError"):
        load_policy("ordering", "gone", allow_plugins=["ordering.gone"], registry=reg)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("NotAnOrdering", r"does not implement the OrderingPolicy protocol"),
        ("NoParamsStruct", r"has no Params Struct"),
        ("Picky", r"^policies\.ordering\.params: 'ordering\.x' refused its parameters: needs a tenant table"),
    ],
)
def test_a_plugin_that_is_not_a_usable_policy_is_refused(target: str, message: str) -> None:
    reg = registry(spec("ordering.x", f"{__name__}:{target}"))
    with pytest.raises(PolicyError, match=message):
        load_policy("ordering", "x", allow_plugins=["ordering.x"], registry=reg)


def test_available_skips_malformed_names_and_reports_the_distribution() -> None:
    points = [
        EntryPoint("ordering.fine", "m:C", "tierserve.policies"),
        EntryPoint("nodot", "m:C", "tierserve.policies"),
        EntryPoint("notakind.x", "m:C", "tierserve.policies"),
        EntryPoint("ordering.", "m:C", "tierserve.policies"),
    ]
    specs = available(points)
    assert list(specs) == ["ordering.fine"]
    assert specs["ordering.fine"].distribution == "?"  # no distribution behind a hand-made entry point
    assert not specs["ordering.fine"].is_builtin
