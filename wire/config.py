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
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, field

from wire.config_load import ConfigError, blame, decode, env_overrides, read_toml
from wire.config_rules import validate
from wire.tier import DEFAULT_TIERS, OPENAI_SERVICE_TIERS, Tier

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
# What a pool (and the worker's --model) serves unless told: the embedded model from its own Q4_1 GGUF,
# served from its blocks (`tierserve bench quant`: top-1 agreement with the float weights 1.000).
# "default" names the float folder (one line away: path = "default").
DEFAULT_MODEL_PATH = "default-q4_1"
ENV_PREFIX = "TIERSERVE_"
CONFIG_PATH_ENV = "TIERSERVE_CONFIG"
# TIERSERVE_* variables that other parts read; everything else with the prefix must be a config key,
# so a typo (TIERSERVE_GATEWAY_PORT) fails loudly instead of being silently ignored.
NON_CONFIG_ENV_VARS = frozenset(
    {
        "TIERSERVE_CACHE",
        "TIERSERVE_CPU_ISA",  # worker/cpu_isa.py: treat the CPU as a lower ISA level
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
    # a Hugging Face folder, a GGUF file, "default-q4_1" (the embedded model from its Q4_1 GGUF) or
    # "default" (the same model's float weights)
    path: Name = DEFAULT_MODEL_PATH
    # auto: bf16 on CUDA and on CPUs with native bf16 (AVX-512-BF16, AMX), float32 on other CPUs
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # auto: CUDA when serve sees a GPU, else the CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: one worker per GPU of ``devices`` (every visible GPU when empty); 1 on a CPU box
    num_workers: PosInt | Literal["auto"] = "auto"
    # indices of the GPUs serve sees (as torch numbers them) its workers are pinned to; empty: all
    devices: tuple[Annotated[int, Meta(ge=0)], ...] = ()
    # Each worker splits the model over this many ranks (GPUs on CUDA, processes on a CPU box) with
    # torch.distributed; float weights only. On GPUs a worker takes this many consecutive ``devices``.
    tensor_parallel_size: PosInt = 1
    # None: 1 GiB on CPU; on CUDA what gpu_memory_utilization leaves after the weights and a warm-up
    kv_cache_gb: PosFloat | None = None
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.9
    cuda_graphs: bool = True  # decode steps replay CUDA graphs on CUDA with the Triton kernels
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
    # A GGUF path's quantized linears quantize their input per block of 32 to int16 (close to the
    # float product) or int8 (llama.cpp's arithmetic: faster with many rows, ~3% of greedy tokens differ)
    quant_activations: Literal["int16", "int8"] = "int16"
    # A float checkpoint's linears quantized at load: int8 (8-bit blocks of 32, GGUF Q8_0) or int4
    # (4-bit asymmetric groups of 32, Q4_1); none keeps them float. A GGUF path is quantized already.
    quantization: Literal["none", "int8", "int4"] = "none"
    # auto: the model's dtype. bfloat16 under a float32 or quantized model on CPU: K/V rounded to bf16
    # where they are stored, half the bytes a decode step's attention reads, twice the tokens per GiB.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Modules of a quantized model kept in float (mixed precision; wire/full_precision.py names them):
    # e.g. ["attention", "lm_head"]. A quantized checkpoint's are dequantized at load.
    keep_full_precision: tuple[Name, ...] = ()

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
    """Tier-aware by default; ``fcfs`` / ``static`` / ``newest`` / ``lru`` is first come first served
    (docs/policies.md says when to choose it)."""

    ordering: PolicySelection = _policy("tiered")
    budget: PolicySelection = _policy("slo-budget")
    preemption: PolicySelection = _policy("lowest-tier")
    eviction: PolicySelection = _policy("priority-weighted")
    admission: PolicySelection = _policy("bounded-queue")
    routing: PolicySelection = _policy("least-loaded")
    degradation: PolicySelection = _policy("never")
    allow_plugins: tuple[Name, ...] = ()  # entry-point plugin names that may load; built-ins always may

    def worker_selections(self) -> dict[str, Any]:
        """The worker kinds as a worker's ``--policies`` JSON object (plugins allowed included)."""
        chosen: dict[str, Any] = {
            kind: {"name": getattr(self, kind).name, "params": dict(getattr(self, kind).params)}
            for kind in WORKER_POLICY_KINDS
        }
        chosen["allow_plugins"] = list(self.allow_plugins)
        return chosen


WORKER_POLICY_KINDS = ("ordering", "budget", "preemption", "eviction")  # the rest run in the gateway
POLICY_KINDS = tuple(f for f in PoliciesConfig.__struct_fields__ if f != "allow_plugins")


class TelemetryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    service_name: Name = "tierserve"
    metrics_enabled: bool = True


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    default_tier: Name = "standard"
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    tiers: tuple[Tier, ...] = DEFAULT_TIERS
    # OpenAI's ``service_tier`` values (default, flex, priority, scale) → tier names. None: priority is
    # the most urgent tier, default the server's default_tier, flex the least urgent (see service_tier).
    service_tiers: dict[str, Name] | None = None
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

    def service_tier_map(self) -> dict[str, str]:
        """OpenAI's ``service_tier`` names → tier names: ``service_tiers``, else the default mapping."""
        if self.service_tiers is not None:
            return dict(self.service_tiers)
        by_urgency = self.tiers_by_urgency
        return {"priority": by_urgency[0].name, "default": self.default_tier, "flex": by_urgency[-1].name}

    def service_tier(self, name: str) -> Tier:
        """The tier OpenAI's ``service_tier`` ``name`` runs at; ``KeyError`` naming the values served."""
        mapping = self.service_tier_map()
        if name not in mapping:
            raise KeyError(f"unknown service_tier {name!r} (served: auto, {', '.join(sorted(mapping))})")
        return self.tier(mapping[name])

    def service_tier_name(self, tier: Tier) -> str | None:
        """What OpenAI's ``service_tier`` calls ``tier`` (a response says it): the first name mapped to it
        in default, priority, flex, scale order; None when none is."""
        mapping = self.service_tier_map()
        return next((name for name in OPENAI_SERVICE_TIERS if mapping.get(name) == tier.name), None)

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
    validate(config, lambda key, message: ConfigError(key, message, env_var=blame(key, origins)))
    return config


def _expand_policy_shorthand(tree: dict[str, Any]) -> dict[str, Any]:
    """``ordering = "fcfs"`` means ``ordering = {name = "fcfs"}``: most selections need no params."""
    policies = tree.get("policies")
    if isinstance(policies, dict):
        for kind in POLICY_KINDS:
            if isinstance(policies.get(kind), str):
                policies[kind] = {"name": policies[kind]}
    return tree
