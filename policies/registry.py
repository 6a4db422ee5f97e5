"""Policy names → instances, through one path for built-ins and plugins alike: Python entry points.

    [project.entry-points."tierserve.policies"]          (in any installed package's pyproject.toml)
    "ordering.short-first" = "my_package.short:ShortFirst"

The entry point's name is ``<kind>.<name>``; the config selects ``policies.<kind> = "<name>"`` with
optional ``params``. tierserve's own built-ins are registered the same way (in its pyproject.toml).
A plugin from any other distribution loads only if ``policies.allow_plugins`` lists its
``<kind>.<name>``: installing a package must not be enough to change how a server schedules.

Everything that can go wrong (unknown name, not allowed, import error, wrong kind, bad params, an
object that does not satisfy its kind's Protocol) raises :class:`PolicyError` naming the policy and the
config key, so startup stops with a message a person can act on.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import msgspec

from policies.admission import AdmissionPolicy
from policies.base import (
    POLICY_KINDS,
    BudgetPolicy,
    EvictionPolicy,
    OrderingPolicy,
    PolicyKind,
    PreemptionPolicy,
)
from policies.degradation import DegradationPolicy
from policies.routing import RoutingPolicy

ENTRY_POINT_GROUP = "tierserve.policies"
BUILTIN_DISTRIBUTION = "tierserve"

# The Protocol an instance of each kind must satisfy.
PROTOCOLS: dict[str, type] = {
    "ordering": OrderingPolicy,
    "budget": BudgetPolicy,
    "preemption": PreemptionPolicy,
    "eviction": EvictionPolicy,
    "admission": AdmissionPolicy,
    "routing": RoutingPolicy,
    "degradation": DegradationPolicy,
}


class PolicyError(Exception):
    """A selected policy cannot be used; the message names it and the config key to change."""


@dataclass(frozen=True, slots=True)
class PolicySpec:
    kind: str
    name: str
    distribution: str  # the installed package that registered it
    entry_point: EntryPoint

    @property
    def is_builtin(self) -> bool:
        return self.distribution == BUILTIN_DISTRIBUTION

    @property
    def key(self) -> str:
        return f"{self.kind}.{self.name}"


def available(points: Iterable[EntryPoint] | None = None) -> dict[str, PolicySpec]:
    """Every registered policy by ``<kind>.<name>``; malformed entry-point names are skipped."""
    specs: dict[str, PolicySpec] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP) if points is None else points:
        kind, dot, name = point.name.partition(".")
        if not dot or kind not in POLICY_KINDS or not name:
            continue
        dist = point.dist.name if point.dist is not None else "?"
        specs[point.name] = PolicySpec(kind, name, dist, point)
    return specs


def effective_params(
    kind: PolicyKind,
    name: str,
    params: Mapping[str, Any] | None = None,
    *,
    allow_plugins: Collection[str] = (),
    registry: Mapping[str, PolicySpec] | None = None,
) -> dict[str, Any]:
    """Every parameter of the ``kind`` policy ``name`` as it would run with ``params``: the given ones
    and the defaults (``tierserve config show``); :class:`PolicyError` as :func:`load_policy`."""
    policy = load_policy(kind, name, params, allow_plugins=allow_plugins, registry=registry)
    typed = msgspec.convert(dict(params or {}), type(policy).Params, strict=False)
    builtins = msgspec.to_builtins(typed)
    return builtins if isinstance(builtins, dict) else {}


def load_policy(
    kind: PolicyKind,
    name: str,
    params: Mapping[str, Any] | None = None,
    *,
    allow_plugins: Collection[str] = (),
    registry: Mapping[str, PolicySpec] | None = None,
) -> Any:
    """An instance of the ``kind`` policy called ``name``, built from ``params``; :class:`PolicyError`
    otherwise."""
    where = f"policies.{kind}"
    specs = available() if registry is None else registry
    spec = specs.get(f"{kind}.{name}")
    if spec is None:
        known = sorted(s.name for s in specs.values() if s.kind == kind)
        raise PolicyError(f"{where}: no {kind} policy named {name!r} (known: {', '.join(known) or 'none'})")
    if not spec.is_builtin and spec.key not in allow_plugins:
        raise PolicyError(
            f"{where}: {spec.key!r} is a plugin from the package {spec.distribution!r}; list it in "
            f"policies.allow_plugins to load it"
        )
    try:
        cls = spec.entry_point.load()
    except Exception as exc:  # an import error in someone else's package: say whose
        raise PolicyError(
            f"{where}: plugin {spec.key!r} ({spec.entry_point.value}) failed to load: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    declared = getattr(cls, "kind", None)
    if declared != kind:
        raise PolicyError(f"{where}: {spec.key!r} declares kind {declared!r}, not {kind!r}")
    params_type = getattr(cls, "Params", None)
    if not (isinstance(params_type, type) and issubclass(params_type, msgspec.Struct)):
        raise PolicyError(f"{where}: {spec.key!r} has no Params Struct")
    try:
        # Lax: TOML table keys and JSON object keys are strings even where a policy wants ints.
        typed = msgspec.convert(dict(params or {}), params_type, strict=False)
    except msgspec.ValidationError as exc:
        raise PolicyError(f"{where}.params: invalid parameters for {spec.key!r}: {exc}") from None
    try:
        policy = cls(typed)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"{where}.params: {spec.key!r} refused its parameters: {exc}") from None
    protocol = PROTOCOLS.get(kind)
    if protocol is not None and not isinstance(policy, protocol):
        raise PolicyError(f"{where}: {spec.key!r} does not implement the {protocol.__name__} protocol")
    return policy
