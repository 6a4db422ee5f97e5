"""The worker's policies, one per kind, as the scheduler and the block pool use them.

    ordering ─┐
    budget ───┼─ Scheduler.schedule()      (which requests run this step, and how much of each)
    preemption┘
    eviction ─── BlockPool._take()          (which free cached block is reused)

Built from the config's ``[policies]`` selections through ``policies.registry`` (the daemon gets them
from ``serve`` as JSON); kinds not given get the configuration's defaults (the tiered set). The
Python API's engine, built without policies, runs the baseline (fcfs, static, newest, lru).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from policies.base import BudgetPolicy, EvictionPolicy, NoParams, OrderingPolicy, PreemptionPolicy
from policies.budget import SloBudget, SloBudgetParams, Static
from policies.eviction import Lru, PriorityWeighted, PriorityWeightedParams
from policies.ordering import Fcfs, Tiered, TieredParams
from policies.preemption import LowestTier, Newest
from policies.registry import load_policy
from wire.config import WORKER_POLICY_KINDS, PoliciesConfig

WORKER_KINDS = WORKER_POLICY_KINDS


@dataclass(slots=True)
class WorkerPolicies:
    ordering: OrderingPolicy
    budget: BudgetPolicy
    preemption: PreemptionPolicy
    eviction: EvictionPolicy

    @classmethod
    def baseline(cls) -> WorkerPolicies:
        """Today's behaviour before tiers: first come first served, static budget, newest victim, LRU."""
        return cls(Fcfs(NoParams()), Static(NoParams()), Newest(NoParams()), Lru(NoParams()))

    @classmethod
    def tiered(cls) -> WorkerPolicies:
        """The tier-aware set with default parameters."""
        return cls(
            Tiered(TieredParams()),
            SloBudget(SloBudgetParams()),
            LowestTier(NoParams()),
            PriorityWeighted(PriorityWeightedParams()),
        )

    @classmethod
    def load(
        cls, selections: Mapping[str, Mapping[str, Any]], allow_plugins: Collection[str] = ()
    ) -> WorkerPolicies:
        """From ``{"ordering": {"name": "tiered", "params": {...}}, ...}``; raises PolicyError."""
        unknown = set(selections) - set(WORKER_KINDS)
        if unknown:
            raise ValueError(f"not worker policy kinds: {sorted(unknown)} (known: {', '.join(WORKER_KINDS)})")
        chosen = cls.baseline()
        defaults = PoliciesConfig().worker_selections()
        for kind in WORKER_KINDS:
            selection = selections.get(kind) or defaults[kind]
            policy = load_policy(
                kind,  # type: ignore[arg-type]  # checked against WORKER_KINDS above
                str(selection["name"]),
                selection.get("params") or {},
                allow_plugins=allow_plugins,
            )
            setattr(chosen, kind, policy)
        return chosen

    def describe(self) -> str:
        return " ".join(f"{kind}={type(getattr(self, kind)).__name__}" for kind in WORKER_KINDS)
