"""Every bad file names the key that must change: the types decoding checks (the first rows), then the
cross-field rules of wire/config_rules.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.wire.config_files import TWO_TENANTS, load_text
from wire.config import ConfigError

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
        "[service_tiers]\nflex = 'gold'\n",
        "service_tiers.flex",
        "unknown tier 'gold' (known: batch, interactive",
    ),
    ("[service_tiers]\nauto = 'batch'\n", "service_tiers.auto", "not one of OpenAI's service_tier values"),
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


def test_a_duplicated_key_is_never_echoed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, TWO_TENANTS.replace("key-b", "key-a"))
    assert "key-a" not in str(info.value)
