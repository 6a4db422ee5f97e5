"""Loading the configuration (wire/config_load.py): environment overrides, the variable named in every
error they cause, unreadable and malformed files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.wire.config_files import EXAMPLE, TWO_TENANTS, load_text
from wire.config import ConfigError, load_config


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


def test_env_sets_one_key_of_an_optional_table_left_unset() -> None:
    config = load_config(env={"TIERSERVE_SERVICE_TIERS__FLEX": "standard"})
    assert config.service_tiers == {"flex": "standard"}
    with pytest.raises(ConfigError) as info:
        load_config(env={"TIERSERVE_SERVICE_TIERS__FLEX": "gold"})
    assert (info.value.key, info.value.env_var) == ("service_tiers.flex", "TIERSERVE_SERVICE_TIERS__FLEX")


def test_tierserve_config_names_the_file() -> None:
    config = load_config(env={"TIERSERVE_CONFIG": str(EXAMPLE)})
    assert config.tenants[0].name == "chat-frontend"


def test_string_values_from_env_stay_verbatim() -> None:
    # "123" and "true" would parse as TOML scalars; a string field must still get the text as written.
    config = load_config(env={"TIERSERVE_TELEMETRY__SERVICE_NAME": "123", "TIERSERVE_GATEWAY__HOST": "::1"})
    assert config.telemetry.service_name == "123"
    assert config.gateway.host == "::1"


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


@given(st.integers(min_value=-(2**40), max_value=2**40))
def test_port_from_env_is_taken_when_in_range_and_named_when_not(port: int) -> None:
    env = {"TIERSERVE_GATEWAY__PORT": str(port)}
    if 0 <= port <= 65535:
        assert load_config(env=env).gateway.port == port
    else:
        with pytest.raises(ConfigError) as info:
            load_config(env=env)
        assert info.value.key == "TIERSERVE_GATEWAY__PORT"
