"""The server's one configuration schema, loaded from TOML plus ``TIERSERVE_*`` variables and validated.

    defaults  <  TOML file  <  TIERSERVE_<SECTION>__<KEY>=value      (later wins)

Every mistake is a :class:`ConfigError` that names the key (``tenants[1].max_tier``) or the variable
(``TIERSERVE_GATEWAY__PORT``) at fault, so a person can fix it without reading this file.
``docs/configuration.md`` lists every key; ``examples/tierserve.toml`` is loaded by the tests.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, field

from wire.config_load import ConfigError, blame, decode, env_overrides, read_toml
from wire.curve import CurveKeyError, load_authorized_keys, load_key_pair
from wire.tier import DEFAULT_TIERS, Tier

__all__ = [
    "ConfigError",
    "ContextClass",
    "GatewayConfig",
    "ModelPool",
    "ModelsConfig",
    "PoliciesConfig",
    "PolicySelection",
    "ServerConfig",
    "TelemetryConfig",
    "Tenant",
    "TierNotAllowedError",
    "load_config",
]

# Mirrors worker.models.store.DEFAULT_MODEL: wire/ may not import the worker.
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
ENV_PREFIX = "TIERSERVE_"
CONFIG_PATH_ENV = "TIERSERVE_CONFIG"
# TIERSERVE_* variables that other parts read; everything else with the prefix must be a config key,
# so a typo (TIERSERVE_GATEWAY_PORT) fails loudly instead of being silently ignored.
NON_CONFIG_ENV_VARS = frozenset(
    {
        "TIERSERVE_CACHE",
        CONFIG_PATH_ENV,
        "TIERSERVE_FAILOVER_TRIALS",
        "TIERSERVE_FAILOVER_SEED",
        "TIERSERVE_FAILOVER_SMOLLM2_TRIALS",
        "TIERSERVE_APM_TEST",
        "TIERSERVE_APM_PHOENIX",
    }  # the rest: knobs of tests/e2e
)

PosInt = Annotated[int, Meta(ge=1)]
PosFloat = Annotated[float, Meta(gt=0)]
Name = Annotated[str, Meta(min_length=1)]


class TierNotAllowedError(ValueError):
    """A tenant asked for a tier more urgent than it may use."""

    def __init__(self, requested: str, allowed: str, tenant: str) -> None:
        super().__init__(f"tier {requested!r} is above what tenant {tenant!r} may use (at most {allowed!r})")
        self.requested = requested
        self.allowed = allowed


class ContextClass(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A named band of prompt lengths: requests are classified by their prompt's token count, echoed
    in ``x-context-class`` and (with the routing issue) matched to pools that serve that band."""

    name: Name
    max_prompt_tokens: PosInt | None = None  # None: no upper bound (must be the last class)


DEFAULT_CONTEXT_CLASSES = (
    ContextClass(name="short", max_prompt_tokens=1024),
    ContextClass(name="medium", max_prompt_tokens=8192),
    ContextClass(name="long"),
)


class GatewayConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000  # 0: the OS picks a free port (tests)
    max_body_bytes: PosInt = 1 << 20
    max_n: PosInt = 8
    max_prompts: PosInt = 64  # prompts in one /v1/completions request
    # Sequences admitted per worker, as a multiple of its max_num_seqs; more wait in per-tier queues here.
    max_in_flight_factor: Annotated[float, Meta(ge=1.0)] = 2.0
    request_timeout_s: PosFloat = 600.0
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 30.0
    # Failure handling (gateway/dispatch.py): a worker silent this long is ejected and its requests
    # migrate; one with requests but no engine step for hang_timeout_s (a hang) likewise.
    heartbeat_timeout_s: PosFloat = 3.0
    hang_timeout_s: PosFloat = 30.0
    max_migrations: Annotated[int, Meta(ge=0)] = 2  # per request; 0: a lost worker fails its streams
    require_api_key: bool = False
    # Key of the per-tenant prefix-cache salt (HMAC-SHA256 of the tenant's name). Unset: a random key
    # per gateway start. Gateways sharing a fleet should share it, so a tenant's cache follows it.
    cache_salt_secret: str | None = None
    # Where the workers dial in (the dispatcher's ROUTER): tcp://HOST:PORT or ipc://PATH. Port 0 picks a
    # free port, fine for the workers serve starts itself; a fleet started elsewhere needs a fixed one.
    worker_address: str = "tcp://127.0.0.1:0"
    # CURVE on the worker links (docs/operations.md): this gateway's key pair (a .key_secret file) and
    # the directory of the public keys (*.key) of the workers it lets in. Both, or neither (no CURVE).
    curve_secret_key_file: str | None = None
    curve_authorized_keys_dir: str | None = None
    context_classes: tuple[ContextClass, ...] = DEFAULT_CONTEXT_CLASSES  # ascending max_prompt_tokens

    def context_class(self, num_prompt_tokens: int) -> str:
        """The first class whose bound holds ``num_prompt_tokens``."""
        for band in self.context_classes:
            if band.max_prompt_tokens is None or num_prompt_tokens <= band.max_prompt_tokens:
                return band.name
        return self.context_classes[-1].name


class Tenant(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Who is calling. Keys are given in plain text or, to keep secrets out of the file, as SHA-256 hex."""

    name: Name
    api_keys: tuple[str, ...] = ()
    api_key_sha256: tuple[str, ...] = ()
    default_tier: str | None = None  # None: the server's default_tier
    max_tier: str | None = None  # the most urgent tier this tenant may ask for; None: any

    def key_digests(self) -> tuple[bytes, ...]:
        plain = tuple(hashlib.sha256(key.encode()).digest() for key in self.api_keys)
        return plain + tuple(bytes.fromhex(digest) for digest in self.api_key_sha256)


class ModelPool(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Name  # the served model name clients put in "model"
    path: Name = "default"  # a Hugging Face folder, a GGUF file, or "default" (the embedded model)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    num_workers: PosInt = 1
    kv_cache_gb: PosFloat = 1.0
    max_num_seqs: PosInt = 64
    max_num_batched_tokens: PosInt = 2048
    role: Literal["primary", "fallback"] = "primary"
    max_context: Annotated[int, Meta(ge=2)] | None = None  # None: the model's own limit
    # The model name clients use, when it is not ``name``: several primary pools of one model may
    # share it when each declares ``context_classes`` (disjoint), e.g. a long-context pool with a
    # large KV cache beside a pool for short prompts.
    served_name: Name | None = None
    # gateway.context_classes this pool's workers take (empty: every class).
    context_classes: tuple[Name, ...] = ()

    @property
    def model_name(self) -> str:
        return self.served_name or self.name


class ModelsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pools: tuple[ModelPool, ...] = (ModelPool(name=DEFAULT_MODEL_NAME),)


class PolicySelection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A policy by registered name plus its parameters; the policies package resolves the name."""

    name: Name
    params: dict[str, Any] = field(default_factory=dict)


def _policy(name: str) -> Any:
    return field(default_factory=lambda: PolicySelection(name=name))


class PoliciesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    ordering: PolicySelection = _policy("fcfs")
    budget: PolicySelection = _policy("static")
    preemption: PolicySelection = _policy("newest")
    eviction: PolicySelection = _policy("lru")
    admission: PolicySelection = _policy("bounded-queue")
    routing: PolicySelection = _policy("least-loaded")
    degradation: PolicySelection = _policy("never")
    allow_plugins: tuple[Name, ...] = ()  # entry-point plugin names that may load; built-ins always may


POLICY_KINDS = tuple(f for f in PoliciesConfig.__struct_fields__ if f != "allow_plugins")


class TelemetryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    service_name: Name = "tierserve"
    metrics_enabled: bool = True


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    default_tier: Name = "standard"
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    tiers: tuple[Tier, ...] = DEFAULT_TIERS
    tenants: tuple[Tenant, ...] = (Tenant(name="anonymous"),)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    policies: PoliciesConfig = field(default_factory=PoliciesConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def tier(self, name: str) -> Tier:
        """The tier called ``name``; ``KeyError`` naming the known tiers otherwise."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"unknown tier {name!r} (known: {', '.join(t.name for t in self.tiers_by_urgency)})")

    def tier_by_rank(self, rank: int) -> Tier:
        for tier in self.tiers:
            if tier.rank == rank:
                return tier
        raise KeyError(f"no tier has rank {rank}")

    @property
    def tiers_by_urgency(self) -> tuple[Tier, ...]:
        """Most urgent (lowest rank) first."""
        return tuple(sorted(self.tiers, key=lambda t: t.rank))

    def resolve_tier(self, tenant: Tenant, requested: str | None = None) -> Tier:
        """The tier a request runs at: the one asked for, else the tenant's default, else the server's.

        A request may lower itself freely but never rise above its tenant's ``max_tier``: asking for a
        more urgent tier raises :class:`TierNotAllowedError` (the gateway answers 403). ``KeyError``
        for an unknown requested name.
        """
        tier = self.tier(requested or tenant.default_tier or self.default_tier)
        if tenant.max_tier is not None:
            cap = self.tier(tenant.max_tier)
            if tier.rank < cap.rank:
                raise TierNotAllowedError(tier.name, cap.name, tenant.name)
        return tier

    def tenant_for_key(self, key: str) -> Tenant | None:
        """The tenant owning ``key``, comparing SHA-256 digests in constant time.

        Every stored digest is compared (no early exit), so timing reveals neither which tenant
        matched nor how much of a key was right.
        """
        if not key:
            return None
        digest = hashlib.sha256(key.encode()).digest()
        found: Tenant | None = None
        for tenant in self.tenants:
            for stored in tenant.key_digests():
                if hmac.compare_digest(digest, stored) and found is None:
                    found = tenant
        return found

    def anonymous_tenant(self) -> Tenant | None:
        """The keyless tenant for requests without a key; None when keys are required."""
        if self.gateway.require_api_key:
            return None
        return next((t for t in self.tenants if not t.api_keys and not t.api_key_sha256), None)

    def pools(self, role: Literal["primary", "fallback"]) -> tuple[ModelPool, ...]:
        return tuple(pool for pool in self.models.pools if pool.role == role)


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    """Defaults, then the TOML file at ``path`` (else ``$TIERSERVE_CONFIG``, else none), then ``env``.

    ``env`` defaults to ``os.environ``. Raises :class:`ConfigError` naming the key or variable at fault.
    """
    env = os.environ if env is None else env
    if path is None and env.get(CONFIG_PATH_ENV):
        path = env[CONFIG_PATH_ENV]
    raw: dict[str, Any] = read_toml(Path(path)) if path is not None else {}
    # Decode the file alone first: its errors name file keys, and overrides get a full tree to index into.
    base = decode(_expand_policy_shorthand(raw), ServerConfig, {})
    tree, origins = env_overrides(base, env, prefix=ENV_PREFIX, ignore=NON_CONFIG_ENV_VARS)
    config = decode(_expand_policy_shorthand(tree), ServerConfig, origins)
    _validate(config, lambda key, message: ConfigError(key, message, env_var=blame(key, origins)))
    return config


def _expand_policy_shorthand(tree: dict[str, Any]) -> dict[str, Any]:
    """``ordering = "fcfs"`` means ``ordering = {name = "fcfs"}``: most selections need no params."""
    policies = tree.get("policies")
    if isinstance(policies, dict):
        for kind in POLICY_KINDS:
            if isinstance(policies.get(kind), str):
                policies[kind] = {"name": policies[kind]}
    return tree


_Fail = Callable[[str, str], ConfigError]


def _validate(config: ServerConfig, fail: _Fail) -> None:
    """Cross-field rules a type cannot state; each raises naming the key that must change."""
    _validate_tiers(config, fail)
    _validate_tenants(config, fail)
    _validate_pools(config, fail)
    _validate_context_classes(config, fail)
    _validate_liveness(config, fail)
    _validate_worker_link(config, fail)


def _validate_liveness(config: ServerConfig, fail: _Fail) -> None:
    gateway = config.gateway
    # Progress is only learned from heartbeats: a hang timeout below the silence timeout would judge a
    # worker on stats older than the check itself.
    if gateway.hang_timeout_s < gateway.heartbeat_timeout_s:
        raise fail(
            "gateway.hang_timeout_s",
            f"must be at least gateway.heartbeat_timeout_s ({gateway.heartbeat_timeout_s}), "
            f"got {gateway.hang_timeout_s}",
        )


def _validate_shared_model(config: ServerConfig, first: int, i: int, fail: _Fail) -> None:
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
            raise fail(f"{key}.context_classes",
                       f"{sorted(common)} also served by models.pools[{j}]: one pool per class")  # fmt: skip


def _validate_worker_link(config: ServerConfig, fail: _Fail) -> None:
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


def _validate_context_classes(config: ServerConfig, fail: _Fail) -> None:
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


def _validate_tiers(config: ServerConfig, fail: _Fail) -> None:
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


def _check_tier_name(config: ServerConfig, name: str, key: str, fail: _Fail) -> Tier:
    try:
        return config.tier(name)
    except KeyError:
        known = ", ".join(t.name for t in config.tiers_by_urgency)
        raise fail(key, f"unknown tier {name!r} (known: {known})") from None


def _validate_tenants(config: ServerConfig, fail: _Fail) -> None:
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


def _validate_pools(config: ServerConfig, fail: _Fail) -> None:
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
