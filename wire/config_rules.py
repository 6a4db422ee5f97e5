"""The cross-field rules of the server's configuration: what a type cannot state (a tenant's tiers must
exist, pools sharing a served name must split it by context class, CURVE keys come in pairs, ...).

Each rule raises through ``fail(key, message)``, naming the key that must change; ``wire.config``
supplies ``fail`` so the error also names the variable when the value came from the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from wire.config_load import ConfigError
from wire.curve import CurveKeyError, load_authorized_keys, load_key_pair
from wire.full_precision import check_entries
from wire.tier import OPENAI_SERVICE_TIERS, Tier

if TYPE_CHECKING:
    from wire.config import ModelPool, ServerConfig

Fail = Callable[[str, str], ConfigError]


def validate(config: ServerConfig, fail: Fail) -> None:
    """Cross-field rules a type cannot state; each raises naming the key that must change."""
    _validate_tiers(config, fail)
    _validate_tenants(config, fail)
    _validate_service_tiers(config, fail)
    _validate_pools(config, fail)
    _validate_context_classes(config, fail)
    _validate_liveness(config, fail)
    _validate_worker_link(config, fail)


def _validate_liveness(config: ServerConfig, fail: Fail) -> None:
    gateway = config.gateway
    # Progress is only learned from heartbeats: a hang timeout below the silence timeout would judge a
    # worker on stats older than the check itself.
    if gateway.hang_timeout_s < gateway.heartbeat_timeout_s:
        raise fail(
            "gateway.hang_timeout_s",
            f"must be at least gateway.heartbeat_timeout_s ({gateway.heartbeat_timeout_s}), "
            f"got {gateway.hang_timeout_s}",
        )


def _validate_shared_model(config: ServerConfig, first: int, i: int, fail: Fail) -> None:
    """Pools serving one model name split it by context class: the same model, primaries, and each
    class served by one of them (the gateway picks the pool from the prompt's class)."""
    pools = config.models.pools
    key = f"models.pools[{i}]"
    other = pools[first]
    pool = pools[i]
    also = f"(models.pools[{first}] serves {pool.model_name!r} too)"
    if pool.role != "primary" or other.role != "primary":
        raise fail(f"{key}.served_name", f"only primary pools may share a served model name {also}")
    if pool.path != other.path:
        raise fail(f"{key}.path", f"pools serving one model name must load the same model {also}")
    for j, earlier in enumerate(pools[:i]):
        if earlier.model_name != pool.model_name:
            continue
        if not pool.context_classes or not earlier.context_classes:
            why = f"pools sharing a served name must each list their context classes {also}"
            raise fail(f"{key}.context_classes", why)
        common = set(pool.context_classes) & set(earlier.context_classes)
        if common:
            raise fail(
                f"{key}.context_classes",
                f"{sorted(common)} also served by models.pools[{j}]: one pool per class",
            )


def _validate_worker_link(config: ServerConfig, fail: Fail) -> None:
    gateway = config.gateway
    if not gateway.worker_address.startswith(("tcp://", "ipc://")):
        raise fail(
            "gateway.worker_address",
            f"expected tcp://HOST:PORT or ipc://PATH, got {gateway.worker_address!r}",
        )
    secret_file, keys_dir = gateway.curve_secret_key_file, gateway.curve_authorized_keys_dir
    if secret_file is None and keys_dir is not None:
        raise fail(
            "gateway.curve_secret_key_file", "CURVE needs it too: gateway.curve_authorized_keys_dir is set"
        )
    if keys_dir is None and secret_file is not None:
        raise fail(
            "gateway.curve_authorized_keys_dir", "CURVE needs it too: gateway.curve_secret_key_file is set"
        )
    # Read now, so a wrong path stops start-up here rather than as a gateway no worker can reach.
    if secret_file is not None:
        try:
            load_key_pair(secret_file)
        except CurveKeyError as exc:
            raise fail("gateway.curve_secret_key_file", str(exc)) from None
    if keys_dir is not None:
        try:
            load_authorized_keys(keys_dir)
        except CurveKeyError as exc:
            raise fail("gateway.curve_authorized_keys_dir", str(exc)) from None


def _validate_context_classes(config: ServerConfig, fail: Fail) -> None:
    classes = config.gateway.context_classes
    if not classes:
        raise fail("gateway.context_classes", "at least one class is needed")
    bound = 0
    names: set[str] = set()
    for i, band in enumerate(classes):
        key = f"gateway.context_classes[{i}]"
        if band.name in names:
            raise fail(f"{key}.name", f"duplicate context class {band.name!r}")
        names.add(band.name)
        if band.max_prompt_tokens is None:
            if i != len(classes) - 1:
                raise fail(f"{key}.max_prompt_tokens", "only the last class may be unbounded")
        elif band.max_prompt_tokens <= bound:
            raise fail(f"{key}.max_prompt_tokens", f"must grow from class to class (previous: {bound})")
        else:
            bound = band.max_prompt_tokens


def _validate_tiers(config: ServerConfig, fail: Fail) -> None:
    if not config.tiers:
        raise fail("tiers", "at least one tier is needed")
    names: dict[str, int] = {}
    ranks: dict[int, int] = {}
    for i, tier in enumerate(config.tiers):
        if not tier.name:
            raise fail(f"tiers[{i}].name", "must not be empty")
        if tier.name in names:
            raise fail(
                f"tiers[{i}].name", f"duplicate tier name {tier.name!r} (also tiers[{names[tier.name]}])"
            )
        if tier.rank < 0:
            raise fail(f"tiers[{i}].rank", f"must be >= 0 (0 is the most urgent), got {tier.rank}")
        if tier.rank in ranks:
            raise fail(f"tiers[{i}].rank", f"duplicate rank {tier.rank} (also tiers[{ranks[tier.rank]}])")
        for attr in ("ttft_ms", "tpot_ms", "deadline_s"):
            value = getattr(tier, attr)
            if value is not None and not value > 0:
                raise fail(f"tiers[{i}].{attr}", f"must be positive (or left out for no target), got {value}")
        if tier.max_queue < 1:
            raise fail(f"tiers[{i}].max_queue", f"must be at least 1, got {tier.max_queue}")
        names[tier.name] = i
        ranks[tier.rank] = i
    _check_tier_name(config, config.default_tier, "default_tier", fail)


def _check_tier_name(config: ServerConfig, name: str, key: str, fail: Fail) -> Tier:
    try:
        return config.tier(name)
    except KeyError:
        known = ", ".join(t.name for t in config.tiers_by_urgency)
        raise fail(key, f"unknown tier {name!r} (known: {known})") from None


def _validate_service_tiers(config: ServerConfig, fail: Fail) -> None:
    known = {tier.name for tier in config.tiers}
    for name, tier in (config.service_tiers or {}).items():
        if name not in OPENAI_SERVICE_TIERS:
            raise fail(
                f"service_tiers.{name}",
                f"not one of OpenAI's service_tier values {list(OPENAI_SERVICE_TIERS)} (auto always means "
                "the X-SLA-Tier header's or the tenant's tier)",
            )
        if tier not in known:
            raise fail(f"service_tiers.{name}", f"unknown tier {tier!r} (known: {', '.join(sorted(known))})")


def _validate_tenants(config: ServerConfig, fail: Fail) -> None:
    if not config.tenants:
        raise fail("tenants", "at least one tenant is needed (the default is one keyless 'anonymous')")
    names: dict[str, int] = {}
    owners: dict[bytes, str] = {}
    keyless: list[int] = []
    for i, tenant in enumerate(config.tenants):
        at = f"tenants[{i}]"
        if tenant.name in names:
            raise fail(
                f"{at}.name", f"duplicate tenant name {tenant.name!r} (also tenants[{names[tenant.name]}])"
            )
        names[tenant.name] = i
        # The server default was checked with the tiers, so an unknown name here is the tenant's own.
        default = _check_tier_name(
            config, tenant.default_tier or config.default_tier, f"{at}.default_tier", fail
        )
        if tenant.max_tier is not None:
            cap = _check_tier_name(config, tenant.max_tier, f"{at}.max_tier", fail)
            if default.rank < cap.rank:
                whose = "default tier" if tenant.default_tier else "the server's default_tier (unset here)"
                raise fail(
                    f"{at}.default_tier",
                    f"{whose} {default.name!r} is more urgent than max_tier {cap.name!r}",
                )
        for j, key in enumerate(tenant.api_keys):
            if not key.strip():
                raise fail(f"{at}.api_keys[{j}]", "must not be empty")
        for j, digest in enumerate(tenant.api_key_sha256):
            if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
                raise fail(f"{at}.api_key_sha256[{j}]", "expected 64 hex digits: the SHA-256 of the key")
        kinds = [("api_keys", j) for j in range(len(tenant.api_keys))]
        kinds += [("api_key_sha256", j) for j in range(len(tenant.api_key_sha256))]
        for (kind, j), digest_bytes in zip(kinds, tenant.key_digests(), strict=True):
            if digest_bytes in owners:  # one key, two tenants: who is calling would be ambiguous
                raise fail(f"{at}.{kind}[{j}]", f"this key is also given to tenant {owners[digest_bytes]!r}")
            owners[digest_bytes] = tenant.name
        if not kinds:
            keyless.append(i)
    if len(keyless) > 1:
        raise fail(f"tenants[{keyless[1]}].api_keys", "only one tenant may be keyless (the anonymous one)")
    if config.gateway.require_api_key and not owners:
        raise fail("gateway.require_api_key", "keys are required but no tenant has an api key")


def _validate_devices(pool: ModelPool, key: str, fail: Fail) -> None:
    """``devices`` pins workers to GPUs: only for a pool that may run on CUDA, each GPU once."""
    if not pool.devices:
        return
    if pool.device == "cpu":
        raise fail(f"{key}.devices", 'GPU indices need device = "cuda" or "auto", not "cpu"')
    seen: set[int] = set()
    for j, index in enumerate(pool.devices):
        if index < 0:  # the schema refuses it too; kept so the rule holds for any caller
            raise fail(f"{key}.devices[{j}]", f"must be a GPU index >= 0, got {index}")
        if index in seen:
            raise fail(f"{key}.devices[{j}]", f"GPU {index} is listed twice (one worker per GPU)")
        seen.add(index)


def _validate_tensor_parallel(pool: ModelPool, key: str, fail: Fail) -> None:
    """Tensor parallelism splits float weights (worker/models/tensor_parallel.py): a quantized pool is
    refused here rather than by every worker it would start."""
    from wire.config import DEFAULT_MODEL_PATH  # wire.config imports this module

    if pool.tensor_parallel_size == 1:
        return
    size = pool.tensor_parallel_size
    if pool.quantization != "none":
        raise fail(f"{key}.quantization", f'tensor_parallel_size = {size} takes float weights: "none"')
    if pool.path == DEFAULT_MODEL_PATH or pool.path.endswith(".gguf"):
        why = f"tensor_parallel_size = {size} takes float weights; {pool.path!r} is a GGUF file"
        if pool.path == DEFAULT_MODEL_PATH:
            why += ' (the embedded model\'s float weights are path = "default")'
        raise fail(f"{key}.path", why)
    if pool.devices and len(pool.devices) % size:
        why = f"{len(pool.devices)} GPUs do not split into workers of tensor_parallel_size = {size}"
        raise fail(f"{key}.devices", why)


def _validate_pools(config: ServerConfig, fail: Fail) -> None:
    names: dict[str, int] = {}
    served: dict[str, int] = {}  # model name → the first pool serving it
    class_names = {band.name for band in config.gateway.context_classes}
    for i, pool in enumerate(config.models.pools):
        if pool.name in names:
            raise fail(
                f"models.pools[{i}].name",
                f"duplicate pool name {pool.name!r} (also models.pools[{names[pool.name]}])",
            )
        names[pool.name] = i
        try:
            check_entries(pool.keep_full_precision)
        except ValueError as exc:
            raise fail(f"models.pools[{i}].keep_full_precision", str(exc)) from None
        _validate_devices(pool, f"models.pools[{i}]", fail)
        _validate_tensor_parallel(pool, f"models.pools[{i}]", fail)
        for band in pool.context_classes:
            if band not in class_names:
                known = sorted(class_names)
                why = f"unknown context class {band!r} (gateway.context_classes: {known})"
                raise fail(f"models.pools[{i}].context_classes", why)
        first = served.setdefault(pool.model_name, i)
        if first != i:
            _validate_shared_model(config, first, i, fail)
    if not config.pools("primary"):
        raise fail("models.pools", 'at least one pool with role = "primary" is needed')
    fallbacks = [i for i, pool in enumerate(config.models.pools) if pool.role == "fallback"]
    if len(fallbacks) > 1:
        # Degradation sends every primary's degradable traffic to the one fallback pool.
        raise fail(
            f"models.pools[{fallbacks[1]}].role",
            f'only one pool may have role = "fallback" (also models.pools[{fallbacks[0]}])',
        )
