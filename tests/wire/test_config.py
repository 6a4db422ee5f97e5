from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire.config import ConfigError, ServerConfig, Tenant, TierNotAllowedError, load_config
from wire.tier import DEFAULT_TIERS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tierserve.toml"
TWO_TENANTS = """
[[tenants]]
name = "a"
api_keys = ["key-a"]
[[tenants]]
name = "b"
api_keys = ["key-b"]
"""


def load_text(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> ServerConfig:
    path = tmp_path / "tierserve.toml"
    path.write_text(text)
    return load_config(path, env={} if env is None else env)


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


def test_env_overrides_ints_bools_floats_lists_and_nested_keys(tmp_path: Path) -> None:
    env = {
        "TIERSERVE_GATEWAY__PORT": "9100",
        "TIERSERVE_GATEWAY__REQUIRE_API_KEY": "true",
        "TIERSERVE_GATEWAY__DRAIN_TIMEOUT_S": "2.5",
        "TIERSERVE_DEFAULT_TIER": "batch",
        "TIERSERVE_TENANTS__1__MAX_TIER": "standard",
        "TIERSERVE_TIERS__2__MAX_QUEUE": "7",
        "TIERSERVE_POLICIES__ALLOW_PLUGINS": '["acme-routing", "acme-eviction"]',
        "TIERSERVE_POLICIES__ORDERING": "tier-priority",
        "TIERSERVE_POLICIES__ROUTING__PARAMS__PREFIX_WEIGHT": "0.75",
        "TIERSERVE_MODELS__POOLS__0__KV_CACHE_GB": "4",
        "TIERSERVE_CACHE": "/somewhere",  # read by the model store, not config: allowed
    }
    config = load_text(tmp_path, TWO_TENANTS, env)
    assert config.gateway.port == 9100
    assert config.gateway.require_api_key is True
    assert config.gateway.drain_timeout_s == 2.5
    assert config.default_tier == "batch"
    assert config.tenants[1].max_tier == "standard"
    assert config.tenants[0].max_tier is None  # the file's other entries are kept
    assert config.tier("batch").max_queue == 7
    assert config.policies.allow_plugins == ("acme-routing", "acme-eviction")
    assert config.policies.ordering.name == "tier-priority"
    assert config.policies.routing.params == {"prefix_weight": 0.75}
    assert config.models.pools[0].kv_cache_gb == 4.0


def test_env_replaces_a_whole_list_as_json_and_defaults_to_os_environ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIERSERVE_TIERS", '[{"name": "only", "rank": 0}]')
    monkeypatch.setenv("TIERSERVE_DEFAULT_TIER", "only")
    config = load_config()
    assert [t.name for t in config.tiers] == ["only"]


def test_tierserve_config_names_the_file() -> None:
    config = load_config(env={"TIERSERVE_CONFIG": str(EXAMPLE)})
    assert config.tenants[0].name == "chat-frontend"


def test_string_values_from_env_stay_verbatim() -> None:
    # "123" and "true" would parse as TOML scalars; a string field must still get the text as written.
    config = load_config(env={"TIERSERVE_TELEMETRY__SERVICE_NAME": "123", "TIERSERVE_GATEWAY__HOST": "::1"})
    assert config.telemetry.service_name == "123"
    assert config.gateway.host == "::1"


BAD_FILES = [
    ("[gateway]\nprot = 1\n", "gateway.prot", "unknown key (known: host, port"),
    ("colour = 'red'\n", "colour", "unknown key"),
    ("[gateway]\nport = 'abc'\n", "gateway.port", "expected an integer, got 'abc'"),
    ("[gateway]\nport = -1\n", "gateway.port", ">= 0, got -1"),
    ("[gateway]\nrequire_api_key = 'yes'\n", "gateway.require_api_key", "expected a boolean"),
    ("[[tiers]]\nname = 'a'\nrank = 0\n[[tiers]]\nname = 'a'\nrank = 1\n", "tiers[1].name", "duplicate tier"),
    ("[[tiers]]\nname = 'a'\nrank = 0\n[[tiers]]\nname = 'b'\nrank = 0\n", "tiers[1].rank", "duplicate rank"),
    ("[[tiers]]\nname = 'a'\nrank = -1\n", "tiers[0].rank", "must be >= 0"),
    ("[[tiers]]\nrank = 0\n", "tiers[0].name", "required key is missing"),
    ("[[tiers]]\nname = 'a'\nrank = 0\nttft_ms = 0\n", "tiers[0].ttft_ms", "must be positive"),
    ("default_tier = 'gold'\n", "default_tier", "unknown tier 'gold' (known: interactive, standard, batch)"),
    (
        "[[tenants]]\nname = 'a'\n[[tenants]]\nname = 'b'\napi_keys = ['k']\nmax_tier = 'gold'\n",
        "tenants[1].max_tier",
        "unknown tier 'gold' (known: interactive, standard, batch)",
    ),
    (
        "[[tenants]]\nname = 'a'\ndefault_tier = 'interactive'\nmax_tier = 'standard'\n",
        "tenants[0].default_tier",
        "more urgent than max_tier 'standard'",
    ),
    (
        "[[tenants]]\nname = 'a'\nmax_tier = 'batch'\n",
        "tenants[0].default_tier",
        "the server's default_tier (unset here) 'standard' is more urgent than max_tier 'batch'",
    ),
    ("[[tenants]]\nname = 'a'\napi_keys = ['']\n", "tenants[0].api_keys[0]", "must not be empty"),
    ("[[tenants]]\nname = 'a'\napi_key_sha256 = ['abc']\n", "tenants[0].api_key_sha256[0]", "64 hex"),
    ("[[tenants]]\nname = ''\n", "tenants[0].name", "length >= 1"),
    (TWO_TENANTS.replace("key-b", "key-a"), "tenants[1].api_keys[0]", "also given to tenant 'a'"),
    (
        "[[tenants]]\nname = 'a'\n[[tenants]]\nname = 'b'\n",
        "tenants[1].api_keys",
        "only one tenant may be keyless",
    ),
    (
        "[[tenants]]\nname = 'a'\n[[tenants]]\nname = 'a'\napi_keys = ['k']\n",
        "tenants[1].name",
        "duplicate tenant",
    ),
    ("[gateway]\nrequire_api_key = true\n", "gateway.require_api_key", "no tenant has an api key"),
    (
        "[[models.pools]]\nname = 'm'\nrole = 'spare'\n",
        "models.pools[0].role",
        "expected one of: fallback, primary",
    ),
    (
        "[[models.pools]]\nname = 'm'\n[[models.pools]]\nname = 'm'\n",
        "models.pools[1].name",
        "duplicate pool",
    ),
    ("[[models.pools]]\nname = 'm'\nrole = 'fallback'\n", "models.pools", 'role = "primary"'),
    (
        "[[models.pools]]\nname = 'a'\ncontext_classes = ['huge']\n",
        "models.pools[0].context_classes",
        "unknown context class 'huge'",
    ),
    (
        "[[models.pools]]\nname = 'a'\nserved_name = 's'\ncontext_classes = ['short']\n"
        "[[models.pools]]\nname = 'b'\nserved_name = 's'\n",
        "models.pools[1].context_classes",
        "must each list their context classes",
    ),
    (
        "[[models.pools]]\nname = 'a'\nserved_name = 's'\ncontext_classes = ['short', 'medium']\n"
        "[[models.pools]]\nname = 'b'\nserved_name = 's'\ncontext_classes = ['medium', 'long']\n",
        "models.pools[1].context_classes",
        "['medium'] also served by models.pools[0]",
    ),
    (
        "[[models.pools]]\nname = 'a'\nserved_name = 's'\ncontext_classes = ['short']\n"
        "[[models.pools]]\nname = 'b'\nserved_name = 's'\npath = '/other'\ncontext_classes = ['long']\n",
        "models.pools[1].path",
        "must load the same model",
    ),
    (
        "[[models.pools]]\nname = 'a'\nserved_name = 's'\ncontext_classes = ['short']\n"
        "[[models.pools]]\nname = 'b'\nserved_name = 's'\nrole = 'fallback'\ncontext_classes = ['long']\n",
        "models.pools[1].served_name",
        "only primary pools may share",
    ),
    ("[[models.pools]]\nname = 'm'\nnum_workers = 0\n", "models.pools[0].num_workers", ">= 1, got 0"),
    (
        "[[models.pools]]\nname = 'm'\nnum_workers = 'all'\n",
        "models.pools[0].num_workers",
        "invalid value 'all' (expected one of: auto, an integer)",
    ),
    ("[[models.pools]]\nname = 'm'\ndevice = 'tpu'\n", "models.pools[0].device", "invalid value 'tpu'"),
    (
        "[[models.pools]]\nname = 'm'\ndevice = 'cpu'\ndevices = [0]\n",
        "models.pools[0].devices",
        'GPU indices need device = "cuda" or "auto"',
    ),
    (
        "[[models.pools]]\nname = 'm'\ndevices = [1, 3, 1]\n",
        "models.pools[0].devices[2]",
        "GPU 1 is listed twice",
    ),
    ("[[models.pools]]\nname = 'm'\ndevices = [-1]\n", "models.pools[0].devices[0]", ">= 0, got -1"),
    (
        "[[models.pools]]\nname = 'm'\ntensor_parallel_size = 2\n",
        "models.pools[0].path",
        "takes float weights; 'default-q4_1' is a GGUF file (the embedded model's float weights are",
    ),
    (
        "[[models.pools]]\nname = 'm'\npath = '/m/x.gguf'\ntensor_parallel_size = 2\n",
        "models.pools[0].path",
        "tensor_parallel_size = 2 takes float weights; '/m/x.gguf' is a GGUF file",
    ),
    (
        "[[models.pools]]\nname = 'm'\npath = 'default'\nquantization = 'int8'\ntensor_parallel_size = 2\n",
        "models.pools[0].quantization",
        'tensor_parallel_size = 2 takes float weights: "none"',
    ),
    (
        "[[models.pools]]\nname = 'm'\npath = 'default'\ndevices = [0, 1, 2]\ntensor_parallel_size = 2\n",
        "models.pools[0].devices",
        "3 GPUs do not split into workers of tensor_parallel_size = 2",
    ),
    (
        "[[models.pools]]\nname = 'm'\ntensor_parallel_size = 0\n",
        "models.pools[0].tensor_parallel_size",
        ">= 1, got 0",
    ),
    (
        "[[models.pools]]\nname = 'm'\ngpu_memory_utilization = 1.5\n",
        "models.pools[0].gpu_memory_utilization",
        "<= 1.0, got 1.5",
    ),
    (
        "[[models.pools]]\nname = 'm'\ngpu_memory_utilization = 0\n",
        "models.pools[0].gpu_memory_utilization",
        "> 0.0, got 0",
    ),
    ("[[models.pools]]\nname = 'm'\nkv_cache_gb = 0\n", "models.pools[0].kv_cache_gb", "> 0.0, got 0"),
    (
        "[[models.pools]]\nname = 'm'\nquantization = 'int4'\nkeep_full_precision = ['attention', 'attn']\n",
        "models.pools[0].keep_full_precision",
        "unknown module 'attn': expected 'attention', 'mlp', 'lm_head'",
    ),
    ("[[models.pools]]\nname = 'm'\ndtype = 'int3'\n", "models.pools[0].dtype", "invalid value 'int3'"),
    ("[policies]\nrouting = { nam = 'x' }\n", "policies.routing.nam", "unknown key (known: name, params)"),
    ("[policies]\nrouting = 3\n", "policies.routing", "expected a table, got 3"),
    (
        "[gateway]\nheartbeat_timeout_s = 5.0\nhang_timeout_s = 2.0\n",
        "gateway.hang_timeout_s",
        "must be at least gateway.heartbeat_timeout_s (5.0), got 2.0",
    ),
    ("[gateway]\nmax_migrations = -1\n", "gateway.max_migrations", ">= 0"),
    (
        "[[gateway.context_classes]]\nname = 'all'\n[[gateway.context_classes]]\nname = 'x'\n",
        "gateway.context_classes[0].max_prompt_tokens",
        "only the last class may be unbounded",
    ),
    (
        "[[gateway.context_classes]]\nname = 'a'\nmax_prompt_tokens = 9\n"
        "[[gateway.context_classes]]\nname = 'b'\nmax_prompt_tokens = 9\n",
        "gateway.context_classes[1].max_prompt_tokens",
        "must grow",
    ),
]


@pytest.mark.parametrize(("text", "key", "fragment"), BAD_FILES, ids=[case[1] for case in BAD_FILES])
def test_bad_file_names_the_key(tmp_path: Path, text: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text)
    assert info.value.key == key
    assert info.value.env_var is None
    assert str(info.value).startswith(f"config error at {key}: ")
    assert fragment in str(info.value)


BAD_ENV = [
    ({"TIERSERVE_GATEWAY__PORT": "abc"}, "TIERSERVE_GATEWAY__PORT: expected an integer, got 'abc'"),
    ({"TIERSERVE_GATEWAY__PORT": "-5"}, "TIERSERVE_GATEWAY__PORT: expected an integer >= 0, got -5"),
    ({"TIERSERVE_GATEWAY__REQUIRE_API_KEY": "yes"}, "TIERSERVE_GATEWAY__REQUIRE_API_KEY: expected a boolean"),
    ({"TIERSERVE_GATEWAY_PORT": "1"}, "TIERSERVE_GATEWAY_PORT: not a config key: the top level has no key"),
    (
        {"TIERSERVE_GATEWAY__PROT": "1"},
        "TIERSERVE_GATEWAY__PROT: not a config key: gateway has no key 'prot'",
    ),
    ({"TIERSERVE_GATEWAY__PORT__X": "1"}, "TIERSERVE_GATEWAY__PORT__X: not a config key: cannot select 'x'"),
    ({"TIERSERVE_TENANTS__3__NAME": "x"}, "TIERSERVE_TENANTS__3__NAME: tenants has 1 entries"),
    ({"TIERSERVE_TIERS": "[{"}, "TIERSERVE_TIERS: cannot parse '[{' as a TOML or JSON value"),
    (
        {"TIERSERVE_MODELS__POOLS__0__ROLE": "spare"},
        "TIERSERVE_MODELS__POOLS__0__ROLE: invalid value 'spare'",
    ),
    (
        {"TIERSERVE_POLICIES__ALLOW_PLUGINS": "acme"},
        "TIERSERVE_POLICIES__ALLOW_PLUGINS: expected a list, got",
    ),
]


@pytest.mark.parametrize(("env", "message"), BAD_ENV, ids=[next(iter(case[0])) for case in BAD_ENV])
def test_bad_env_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    (var,) = env
    assert info.value.key == var
    assert str(info.value).startswith(message)


def test_a_rule_broken_by_an_env_value_names_the_key_and_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"TIERSERVE_TENANTS__0__MAX_TIER": "gold"})
    assert info.value.key == "tenants[0].max_tier"
    assert info.value.env_var == "TIERSERVE_TENANTS__0__MAX_TIER"
    assert "unknown tier 'gold'" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(env={"TIERSERVE_TIERS": '[{"name": "a", "rank": 0, "colour": 1}]'})
    assert info.value.key == "tiers[0].colour"
    assert info.value.env_var == "TIERSERVE_TIERS"


def test_unreadable_and_malformed_files_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(missing, env={})
    assert info.value.key == str(missing)
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_text(tmp_path, "[gateway\n")


def test_a_duplicated_key_is_never_echoed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, TWO_TENANTS.replace("key-b", "key-a"))
    assert "key-a" not in str(info.value)


@given(st.integers(min_value=-(2**40), max_value=2**40))
def test_port_from_env_is_taken_when_in_range_and_named_when_not(port: int) -> None:
    env = {"TIERSERVE_GATEWAY__PORT": str(port)}
    if 0 <= port <= 65535:
        assert load_config(env=env).gateway.port == port
    else:
        with pytest.raises(ConfigError) as info:
            load_config(env=env)
        assert info.value.key == "TIERSERVE_GATEWAY__PORT"


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
