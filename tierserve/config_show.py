"""``tierserve config show [--config FILE]``: the effective configuration as TOML, defaults included.

Defaults, then the file (``--config``, else ``$TIERSERVE_CONFIG``), then ``TIERSERVE_*`` variables, as
``serve`` loads them; each policy's parameters are filled in with the policy's own defaults. What the
output says in comments: where it came from, what OpenAI's ``service_tier`` picks while ``service_tiers``
is unset (the default mapping follows the tiers), how to switch the tiered policies off, and, for each
tier, whether this machine can meet its targets (``tierserve.feasibility``), when a worker has measured
it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import msgspec

from policies.base import POLICY_KINDS
from wire.config import ConfigError, ServerConfig, load_config
from wire.config_toml import dumps

POLICIES_NOTE = (
    "Tier-aware by default: tiered ordering (tiers, then priority, then fairness between tenants),",
    "a step budget that keeps the strictest running TPOT, the least urgent tier preempted and",
    "evicted first. For first come, first served (one tier, no SLOs, throughput only) write",
    '  ordering = "fcfs", budget = "static", preemption = "newest", eviction = "lru"',
    "docs/policies.md says what each one does.",
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tierserve config show", description=__doc__)
    parser.add_argument("--config", help="the TOML file (default: $TIERSERVE_CONFIG, else none)")
    args = parser.parse_args(argv)
    from policies.registry import PolicyError

    try:
        config = load_config(args.config)
        text = render(config, source=args.config)
    except (ConfigError, PolicyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def render(config: ServerConfig, *, source: str | None = None, floors: Path | None = None) -> str:
    """``config`` as TOML with every policy's parameters and the comments described above (the step
    floors read from ``floors``, else the cache's)."""
    from policies.registry import effective_params
    from tierserve.feasibility import tier_notes

    tree: dict[str, Any] = msgspec.to_builtins(config)
    selected = tree["policies"]
    for kind in POLICY_KINDS:
        selection = getattr(config.policies, kind)
        selected[kind]["params"] = effective_params(
            kind, selection.name, selection.params, allow_plugins=config.policies.allow_plugins
        )
    where = f"defaults < {source} < TIERSERVE_* variables" if source else "defaults < TIERSERVE_* variables"
    header = [f"tierserve's effective configuration ({where}), from `tierserve config show`."]
    if config.service_tiers is None:  # left out as None; the mapping it stands for, in words
        mapping = ", ".join(f"{name} -> {tier}" for name, tier in config.service_tier_map().items())
        header.append(f"service_tiers unset: OpenAI's service_tier maps {mapping}")
        header.append("(the most urgent tier, default_tier, the least urgent; docs/configuration.md).")
    comments: dict[str, tuple[str, ...]] = {
        "": tuple(header),
        "policies": POLICIES_NOTE,
    }
    comments.update(tier_notes(config, floors))
    return dumps(tree, comments)
