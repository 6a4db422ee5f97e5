"""The worker's policy set from --policies JSON: kinds not given are the configuration's defaults."""

from __future__ import annotations

import pytest

from policies.budget import SloBudget
from policies.eviction import PriorityWeighted
from policies.ordering import Fcfs, Tiered
from policies.preemption import LowestTier
from worker.policy_set import WorkerPolicies


def test_kinds_not_given_are_the_tiered_defaults_and_named_ones_win() -> None:
    policies = WorkerPolicies.load({"ordering": {"name": "fcfs"}})
    assert isinstance(policies.ordering, Fcfs)
    assert isinstance(policies.budget, SloBudget) and isinstance(policies.preemption, LowestTier)
    assert isinstance(policies.eviction, PriorityWeighted)
    assert isinstance(WorkerPolicies.load({}).ordering, Tiered)
    with pytest.raises(ValueError, match="not worker policy kinds"):
        WorkerPolicies.load({"routing": {"name": "round-robin"}})
