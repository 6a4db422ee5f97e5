"""The configuration schema (wire/config.py): its defaults, the example files, and the lookups the
gateway makes (tenants by key, tiers, context classes, pools). Loading: test_config_load.py; the rules
every bad file breaks: test_config_rules.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.wire.config_files import EXAMPLE, ROOT, load_text
from wire.config import ServerConfig, Tenant, TierNotAllowedError, load_config
from wire.tier import DEFAULT_TIERS


def test_defaults_load_with_no_file_and_empty_env() -> None:
    config = load_config(env={})
    assert config == ServerConfig()
    assert config.tiers == DEFAULT_TIERS
    assert config.default_tier == "standard"
    assert (config.gateway.host, config.gateway.port, config.gateway.require_api_key) == (
        "127.0.0.1",
        8000,
        False,
    )
    assert [(p.name, p.path, p.role) for p in config.models.pools] == [
        ("smollm2-135m-instruct", "default-q4_1", "primary")
    ]
    assert config.policies.ordering.name == "tiered"  # tier-aware by default
    assert (config.policies.budget.name, config.policies.preemption.name) == ("slo-budget", "lowest-tier")
    assert config.policies.routing.name == "least-loaded"
    anonymous = config.anonymous_tenant()
    assert anonymous is not None and anonymous.name == "anonymous"


def test_example_file_loads_and_is_the_one_in_the_docs() -> None:
    config = load_config(EXAMPLE, env={})
    assert config.gateway.require_api_key
    assert [t.name for t in config.tenants] == ["chat-frontend", "nightly-jobs"]
    assert [p.role for p in config.models.pools] == ["primary", "fallback"]
    assert config.policies.ordering.name == "tiered"  # the bare-name shorthand
    assert config.policies.admission.params == {"max_wait_s": {"batch": 30.0}}
    assert config.anonymous_tenant() is None
    # The documentation embeds the example verbatim, so editing one without the other fails here.
    assert EXAMPLE.read_text() in (ROOT / "docs" / "configuration.md").read_text()


def test_the_quantized_primary_example_pairs_a_gguf_with_a_float_fallback() -> None:
    config = load_config(EXAMPLE.with_name("quantized-primary.toml"), env={})
    primary, fallback = config.models.pools
    assert (primary.role, primary.path) == ("primary", "default-q4_1")
    assert (fallback.role, fallback.path) == ("fallback", "default")
    assert config.policies.degradation.name == "degrade-on-slo"
    assert [t.name for t in config.tiers_by_urgency if t.degradable] == ["standard"]


def test_tenant_for_key_matches_plain_and_sha256_keys() -> None:
    digest = hashlib.sha256(b"secret-b").hexdigest()
    config = ServerConfig(
        tenants=(
            Tenant(name="a", api_keys=("secret-a", "secret-a2")),
            Tenant(name="b", api_key_sha256=(digest.upper(),)),
        )
    )
    assert config.tenant_for_key("secret-a") is config.tenants[0]
    assert config.tenant_for_key("secret-a2") is config.tenants[0]
    assert config.tenant_for_key("secret-b") is config.tenants[1]
    assert config.tenant_for_key(digest) is None  # the digest itself is not a key
    assert config.tenant_for_key("secret-") is None
    assert config.tenant_for_key("") is None


def test_example_keys_resolve_to_their_tenants() -> None:
    config = load_config(EXAMPLE, env={})
    tenant = config.tenant_for_key("team-b-secret")
    assert tenant is not None and tenant.name == "nightly-jobs"


def test_tier_lookup_and_ordering_helpers() -> None:
    config = load_config(env={})
    assert config.tier("batch").rank == 2
    assert config.tier_by_rank(0).name == "interactive"
    assert [t.name for t in config.tiers_by_urgency] == ["interactive", "standard", "batch"]
    with pytest.raises(KeyError, match="known: interactive, standard, batch"):
        config.tier("gold")
    with pytest.raises(KeyError):
        config.tier_by_rank(7)
    shuffled = ServerConfig(tiers=tuple(reversed(DEFAULT_TIERS)))
    assert [t.rank for t in shuffled.tiers_by_urgency] == [0, 1, 2]


def test_a_tenant_can_lower_its_tier_but_never_raise_it_above_max_tier() -> None:
    config = load_config(EXAMPLE, env={})
    nightly = config.tenants[1]  # default batch, max standard
    assert config.resolve_tier(nightly).name == "batch"
    assert config.resolve_tier(nightly, "standard").name == "standard"
    with pytest.raises(TierNotAllowedError, match="interactive"):
        config.resolve_tier(nightly, "interactive")  # above its cap: refused, never clamped silently
    chat = config.tenants[0]  # default interactive, no cap
    assert config.resolve_tier(chat).name == "interactive"
    assert config.resolve_tier(chat, "batch").name == "batch"
    with pytest.raises(KeyError):
        config.resolve_tier(chat, "gold")


def test_context_classes_classify_by_prompt_tokens(tmp_path: Path) -> None:
    gateway = load_config(env={}).gateway
    assert [gateway.context_class(n) for n in (1, 1024, 1025, 8192, 10**6)] == [
        "short", "short", "medium", "medium", "long",
    ]  # fmt: skip
    path = tmp_path / "c.toml"
    path.write_text("[[gateway.context_classes]]\nname = 'small'\nmax_prompt_tokens = 10\n"
                    "[[gateway.context_classes]]\nname = 'big'\nmax_prompt_tokens = 20\n")  # fmt: skip
    bounded = load_config(path, env={}).gateway
    assert [bounded.context_class(n) for n in (10, 11, 21)] == ["small", "big", "big"]


def test_keep_full_precision_names_groups_projections_and_paths() -> None:
    from wire.full_precision import check_entries, keeps

    entries = check_entries(["attention", "lm_head", "layers.0", "layers.3.down_proj"])
    names = ["lm_head", "layers.1.qkv_proj", "layers.1.o_proj", "layers.1.gate_up_proj"]
    names += ["layers.0.gate_up_proj", "layers.3.down_proj", "layers.30.down_proj", "layers.13.down_proj"]
    kept = [m for m in names if keeps(entries, m)]
    assert kept == names[:3] + names[4:6]
    assert keeps(("mlp",), "layers.7.down_proj") and not keeps(("mlp",), "lm_head")
    assert keeps(("down_proj",), "layers.2.down_proj") and not keeps((), "lm_head")


def test_pools_of_one_model_may_split_it_by_context_class(tmp_path: Path) -> None:
    config = load_text(
        tmp_path,
        "[[models.pools]]\nname = 'chat'\nserved_name = 'smol'\ncontext_classes = ['short', 'medium']\n"
        "[[models.pools]]\nname = 'chat-long'\nserved_name = 'smol'\ncontext_classes = ['long']\n"
        "kv_cache_gb = 8.0\nmax_context = 8192\n",
    )
    assert [(p.name, p.model_name, p.context_classes) for p in config.models.pools] == [
        ("chat", "smol", ("short", "medium")),
        ("chat-long", "smol", ("long",)),
    ]


def test_pools_default_to_one_worker_per_gpu_on_an_auto_device(tmp_path: Path) -> None:
    (pool,) = load_config(env={}).models.pools
    assert (pool.device, pool.num_workers, pool.devices) == ("auto", "auto", ())
    assert (pool.kv_cache_gb, pool.gpu_memory_utilization, pool.cuda_graphs) == (None, 0.9, True)
    text = "[[models.pools]]\nname = 'm'\ndevice = 'cuda'\ndevices = [1, 3]\ncuda_graphs = false\n"
    (pool,) = load_text(tmp_path, text, env={"TIERSERVE_MODELS__POOLS__0__NUM_WORKERS": "4"}).models.pools
    assert (pool.device, pool.devices, pool.num_workers, pool.cuda_graphs) == ("cuda", (1, 3), 4, False)
    (pool,) = load_text(tmp_path, text, env={"TIERSERVE_MODELS__POOLS__0__NUM_WORKERS": "auto"}).models.pools
    assert pool.num_workers == "auto"
