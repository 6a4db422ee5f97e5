"""Gateway.place (primary or fallback, once per request), place_prompts (the fallback kept only when it can
run the prompts) and routing through the configured policy, on a real Dispatcher whose registry is fed
Register messages directly (no worker processes)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

import pytest

from gateway.dispatch import Dispatcher
from gateway.endpoint import Prompts
from gateway.placement import place_prompts
from gateway.state import Gateway, Placement
from gateway.tokenizer import BytePromptBuilder, PromptBuilder
from gateway.workers import RoutingError, WorkerRegistry
from policies.base import NoParams
from policies.degradation import DegradationView, Pool
from policies.routing import RoundRobin, RouteRequest, WorkerView
from tests.wire.registers import cpu_register
from wire.config import ConfigError, load_config
from wire.messages import Register

CONFIG = """
[gateway]
max_in_flight_factor = 1.0

[[tiers]]
name = "interactive"
rank = 0
ttft_ms = 1000.0
degradable = true

[[tiers]]
name = "standard"
rank = 1
ttft_ms = 3000.0

[[models.pools]]
name = "big"

[[models.pools]]
name = "small"
role = "fallback"

[policies]
routing = "round-robin"
degradation = "degrade-on-slo"
"""


def register(worker_id: str, model: str) -> Register:
    context = 512 if model == "small" else 4096
    return cpu_register(worker_id, model=model, num_kv_blocks=100, max_model_len=context, max_num_seqs=1)


async def make_gateway(tmp_path: Path, *, same_tokenizer: bool = True) -> Gateway:
    (tmp_path / "tierserve.toml").write_text(CONFIG)
    config = load_config(tmp_path / "tierserve.toml", env={})
    dispatcher = Dispatcher("tcp://127.0.0.1:0")
    for worker_id, model in (("big-0", "big"), ("small-0", "small")):
        dispatcher.registry.on_register(register(worker_id, model), 0.0)
    builder = BytePromptBuilder()
    small = builder if same_tokenizer else BytePromptBuilder()  # another object: "another tokenizer"
    return Gateway(dispatcher, config, {"big": builder, "small": small}, 0, fallbacks={"big": "small"})


def test_degradable_tiers_go_to_the_fallback_when_the_primary_is_full_or_down(tmp_path: Path) -> None:
    async def main() -> None:
        gateway = await make_gateway(tmp_path)
        interactive, standard = gateway.config.tier("interactive"), gateway.config.tier("standard")
        try:
            assert isinstance(gateway.dispatcher.registry.routing, RoundRobin)  # the config's choice
            assert gateway.place("big", interactive, 1) == Placement("big", "big")  # idle primary
            # Asking for the fallback by name is just served by it.
            assert gateway.place("small", interactive, 1) == Placement("small", "small")
            # The primary's one seat taken, nothing finished yet: the wait is unknown, counted as late.
            ticket = await gateway.admissions("big").admit(standard)
            assert gateway.place("big", interactive, 1) == Placement("small", "big", is_degraded=True)
            assert gateway.place("big", standard, 1) == Placement("big", "big")  # not degradable
            ticket.release()
            assert gateway.place("big", interactive, 1) == Placement("big", "big")
            # The primary's only worker goes silent: its circuit is open.
            gateway.dispatcher.registry.expire(now=100.0, timeout_s=3.0)
            gateway.dispatcher.registry.on_register(register("small-0", "small"), 100.0)  # still alive
            assert gateway.place("big", interactive, 1) == Placement("small", "big", is_degraded=True)
            assert gateway.place("big", standard, 1) == Placement("big", "big")  # a 503, not a degradation
            # The fallback's prompt limit is its own (512 here), the primary's is not consulted.
            assert gateway.fits("small", 511) and not gateway.fits("small", 512)
            assert not gateway.fits("big", 1)  # no ready worker
        finally:
            await gateway.dispatcher.close()

    asyncio.run(main())


class AlwaysFallback:
    kind: ClassVar[str] = "degradation"
    Params = NoParams

    def decide(self, view: DegradationView) -> Pool:
        return "fallback"


def test_a_policy_breaking_its_invariant_cannot_degrade_a_tier_that_is_not_degradable(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        gateway = await make_gateway(tmp_path)
        gateway.degradation = AlwaysFallback()
        try:
            assert gateway.place("big", gateway.config.tier("standard"), 1) == Placement("big", "big")
            assert gateway.place("big", gateway.config.tier("interactive"), 1).is_degraded
            gateway.dispatcher.registry.expire(now=100.0, timeout_s=3.0)  # the fallback is gone too
            assert gateway.place("big", gateway.config.tier("interactive"), 1) == Placement("big", "big")
        finally:
            await gateway.dispatcher.close()

    asyncio.run(main())


class OutOfRange:
    kind: ClassVar[str] = "routing"

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> int:
        return len(candidates)


def test_the_registry_routes_through_its_policy_and_refuses_a_choice_outside_the_candidates() -> None:
    registry = WorkerRegistry(RoundRobin(NoParams()))
    for worker_id in ("b", "a", "c"):
        registry.on_register(register(worker_id, "big"), 0.0)
    registry.get("a").in_flight_ids.update({"r1", "r2"})  # type: ignore[union-attr]
    picks = [registry.pick("big") for _ in range(4)]
    assert [p.worker.worker_id for p in picks if p is not None] == ["a", "b", "c", "a"]  # load ignored
    assert registry.pick("big", exclude={"a", "b", "c"}) is None
    registry.routing = OutOfRange()
    with pytest.raises(RoutingError, match="OutOfRange chose 3 among 3"):
        registry.pick("big")


def test_serve_launches_every_pool_under_its_name_and_maps_primaries_to_the_fallback(tmp_path: Path) -> None:
    from gateway.serve import ServeOptions
    from gateway.worker_procs import PoolLaunch
    from tierserve.cli import _pools

    (tmp_path / "tierserve.toml").write_text(CONFIG)
    config = load_config(tmp_path / "tierserve.toml", env={})
    launches = _pools(argparse.Namespace(mock=2, model=None, mock_args=""), config)
    assert [(p.name, p.pool.role, p.num_workers, list(p.worker_args)) for p in launches] == [
        ("mock", "primary", 2, ["--mock"]),  # the first primary is "mock", as with no config
        ("small", "fallback", 1, ["--mock"]),
    ]
    options = ServeOptions("127.0.0.1", 0, launches, config)
    assert options.fallbacks == {"mock": "small"} and options.primary_name == "mock"
    clash = PoolLaunch("mock", config.models.pools[1], BytePromptBuilder(), ["--mock"], 1)
    with pytest.raises(ValueError, match="same model name"):
        ServeOptions("127.0.0.1", 0, [launches[0], clash], config)


def test_a_second_fallback_pool_is_a_config_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "tierserve.toml").write_text(
        CONFIG + '\n[[models.pools]]\nname = "tiny"\nrole = "fallback"\n'
    )
    with pytest.raises(ConfigError, match=r"models\.pools\[2\]\.role: only one pool"):
        load_config(tmp_path / "tierserve.toml", env={})


class CountingPrompts:
    """Prompts whose tokens are ``length`` ones, whichever builder; records which builders were used."""

    def __init__(self, length: int, *, has_token_ids: bool = False) -> None:
        self.length = length
        self.builders: list[PromptBuilder] = []
        self.on_tokenize: Callable[[], None] = lambda: None
        self.has_token_ids = has_token_ids

    async def tokenize(self, builder: PromptBuilder) -> list[list[int]]:
        self.builders.append(builder)
        self.on_tokenize()
        return [[1] * self.length]

    def prompts(self) -> Prompts:
        return Prompts("prompt", [], 1, self.has_token_ids, [None], self.tokenize)


@pytest.mark.parametrize(
    ("length", "has_token_ids", "is_same_tokenizer", "expected", "tokenized_for"),
    [
        (10, False, True, Placement("small", "big", is_degraded=True), ["small"]),
        (10, False, False, Placement("small", "big", is_degraded=True), ["small"]),
        (10, True, True, Placement("small", "big", is_degraded=True), ["small"]),
        # Token ids from the primary's tokenizer mean nothing to another one: never tokenized for it.
        (10, True, False, Placement("big", "big"), ["big"]),
        # Too long for the fallback's context (512): the primary, and its own tokens when they differ.
        (600, False, True, Placement("big", "big"), ["small"]),
        (600, False, False, Placement("big", "big"), ["small", "big"]),
        (600, True, True, Placement("big", "big"), ["small"]),
    ],
)
def test_a_proposed_fallback_is_kept_only_when_it_can_run_the_prompts_as_they_are(
    tmp_path: Path,
    length: int,
    has_token_ids: bool,
    is_same_tokenizer: bool,
    expected: Placement,
    tokenized_for: list[str],
) -> None:
    async def main() -> None:
        gateway = await make_gateway(tmp_path, same_tokenizer=is_same_tokenizer)
        gateway.degradation = AlwaysFallback()
        prompts = CountingPrompts(length, has_token_ids=has_token_ids)
        try:
            tier = gateway.config.tier("interactive")
            placement, prompt_ids = await place_prompts(gateway, "big", tier, prompts.prompts(), seats=1)
            assert placement == expected and prompt_ids == [[1] * length]
            names = {id(builder): name for name, builder in gateway.builders.items()}
            if is_same_tokenizer:
                assert len(prompts.builders) == len(tokenized_for) == 1
            else:
                assert [names[id(b)] for b in prompts.builders] == tokenized_for
            # The primary itself is never second-guessed: tokenized once, for it.
            standard = CountingPrompts(length, has_token_ids=has_token_ids)
            primary = await place_prompts(gateway, "big", gateway.config.tier("standard"), standard.prompts(),
                                          seats=1)  # fmt: skip
            assert primary[0] == Placement("big", "big") and standard.builders == [gateway.builders["big"]]
        finally:
            await gateway.dispatcher.close()

    asyncio.run(main())


def test_a_fallback_that_dies_while_the_prompt_is_tokenized_is_not_used(tmp_path: Path) -> None:
    """The policy looked at a ready fallback; by the time the tokens are known it is gone. The check that
    measures the prompt against the fallback's ready workers is the one that catches it."""

    async def main() -> None:
        gateway = await make_gateway(tmp_path, same_tokenizer=False)
        gateway.degradation = AlwaysFallback()
        prompts = CountingPrompts(10)
        registry = gateway.dispatcher.registry

        def fallback_dies() -> None:
            if len(prompts.builders) == 1:
                registry.expire(now=100.0, timeout_s=3.0)
                registry.on_register(register("big-0", "big"), 100.0)

        prompts.on_tokenize = fallback_dies
        try:
            tier = gateway.config.tier("interactive")
            placement, _ = await place_prompts(gateway, "big", tier, prompts.prompts(), seats=1)
            assert placement == Placement("big", "big")
            assert prompts.builders == [gateway.builders["small"], gateway.builders["big"]]
        finally:
            await gateway.dispatcher.close()

    asyncio.run(main())
