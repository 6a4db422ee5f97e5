"""The worker policy sets the benches serve with, as ``[policies]`` sections of a tierserve config.

``tiered`` names nothing: the defaults (tiered, slo-budget, lowest-tier, priority-weighted,
bounded-queue), what a new user gets. ``fcfs`` is the baseline the tiered set is measured against:
first come first served, the static budget (every step as full as the engine's ceilings allow),
the newest request preempted, LRU eviction; the gateway's admission stays the default's.
"""

from __future__ import annotations

DEFAULT_SET = "tiered"  # what serve runs with no [policies] section
POLICY_SETS: dict[str, str] = {
    "fcfs": """
[policies]
ordering = "fcfs"
budget = "static"
preemption = "newest"
eviction = "lru"
admission = "bounded-queue"
""",
    DEFAULT_SET: "",
}
