"""Who is calling and at which tier: ``Authorization: Bearer KEY`` → tenant, ``X-SLA-Tier`` → tier.

    no key ──▶ the keyless tenant (401 if keys are required or there is none)
    a key  ──▶ its tenant (401 if it matches none; ignored when no tenant has a key at all)
    X-SLA-Tier (else the tenant's default) ──▶ Tier   (400 unknown name, 403 above the tenant's max_tier)
    the body's service_tier (OpenAI's) ──▶ Tier       (with_service_tier, once the body is read: the
                                                       same checks; 400 when it names another tier than
                                                       X-SLA-Tier)

The key and the header are resolved once per request, before the body is read, so a caller without a
valid key learns nothing about the request it sent. Error messages never echo the key.

The tenant also fixes the request's prefix-cache salt: HMAC-SHA256 of the tenant's name under
``gateway.cache_salt_secret`` (a random key per process when unset). Workers hash KV blocks with it, so
one tenant's prompts never hit another tenant's cached blocks (and timing cannot reveal them); a client
can neither choose nor see it. vLLM's body field ``cache_salt`` narrows it further (``with_cache_salt``):
within the tenant, only requests sending the same salt share cached blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.errors import APIError
from wire.config import ServerConfig, Tenant, TierNotAllowedError
from wire.tier import Tier

TIER_HEADER = "X-SLA-Tier"
SERVICE_TIER = "service_tier"  # OpenAI's body field, mapped onto a tier (ServerConfig.service_tiers)
_BEARER = "bearer "


_RANDOM_SALT_KEY = secrets.token_bytes(32)  # when no gateway.cache_salt_secret is configured


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: Tenant
    tier: Tier
    cache_salt: str  # derived from the tenant (and within it, a request's own salt: with_cache_salt)
    asked: bool = False  # the tier came from X-SLA-Tier (not the tenant's or the server's default)


def cache_salt(config: ServerConfig, tenant: Tenant) -> str:
    secret = config.gateway.cache_salt_secret
    key = secret.encode() if secret else _RANDOM_SALT_KEY
    return hmac.new(key, tenant.name.encode(), hashlib.sha256).hexdigest()[:32]


MAX_CACHE_SALT_CHARS = 256


def with_cache_salt(identity: Identity, salt: str | None) -> Identity:
    """``identity`` with vLLM's ``cache_salt`` folded into its prefix-cache salt (an HMAC of it under
    the tenant's salt): requests of the tenant sending the same salt share cached blocks, no others
    do, and never another tenant's, whatever salt it sends. Unchanged for None; 400 for an empty or
    overlong one."""
    if salt is None:
        return identity
    if not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise APIError(400, f"cache_salt: 1 to {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
    narrowed = hmac.new(identity.cache_salt.encode(), salt.encode(), hashlib.sha256).hexdigest()[:32]
    return dataclasses.replace(identity, cache_salt=narrowed)


def identify(config: ServerConfig, headers: Mapping[str, str]) -> Identity:
    """The caller's tenant and tier from the request headers (looked up lower-case, as ASGI gives
    them); :class:`APIError` 401 / 400 / 403 otherwise."""
    tenant = _tenant(config, _bearer_key(headers.get("authorization")))
    requested = (headers.get(TIER_HEADER.lower()) or "").strip() or None
    try:
        tier = config.resolve_tier(tenant, requested)
    except TierNotAllowedError as exc:
        raise APIError(403, str(exc), param=TIER_HEADER, code="tier_not_allowed") from None
    except KeyError as exc:
        raise APIError(400, f"{TIER_HEADER}: {exc.args[0]}", param=TIER_HEADER, code="unknown_tier") from None
    return Identity(tenant, tier, cache_salt(config, tenant), asked=requested is not None)


def with_service_tier(config: ServerConfig, identity: Identity, service_tier: str | None) -> Identity:
    """``identity`` at the tier OpenAI's ``service_tier`` names (``config.service_tier``); unchanged
    for None or ``auto``. :class:`APIError` 400 for a value not served or one naming another tier
    than X-SLA-Tier did, 403 above the tenant's ``max_tier``."""
    if service_tier is None or service_tier == "auto":
        return identity
    try:
        tier = config.service_tier(service_tier)
    except KeyError as exc:
        raise APIError(400, exc.args[0], param=SERVICE_TIER, code="unknown_tier") from None
    if identity.asked and tier.name != identity.tier.name:
        raise APIError(
            400,
            f"service_tier {service_tier!r} is tier {tier.name!r} but {TIER_HEADER} asked for "
            f"{identity.tier.name!r}: send one of them",
            param=SERVICE_TIER,
            code="conflicting_tier",
        )
    try:
        config.resolve_tier(identity.tenant, tier.name)
    except TierNotAllowedError as exc:
        raise APIError(
            403, f"service_tier {service_tier!r}: {exc}", param=SERVICE_TIER, code="tier_not_allowed"
        ) from None
    return dataclasses.replace(identity, tier=tier)


def _bearer_key(authorization: str | None) -> str | None:
    """The key of ``Bearer KEY``; "" for any other (malformed) Authorization, so it cannot pass as
    no key at all; None when there is no header."""
    if authorization is None:
        return None
    if authorization[: len(_BEARER)].lower() != _BEARER:
        return ""
    return authorization[len(_BEARER) :].strip()


def _tenant(config: ServerConfig, key: str | None) -> Tenant:
    if key is None:
        anonymous = config.anonymous_tenant()
        if anonymous is None:
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'", "missing_api_key")
        return anonymous
    tenant = config.tenant_for_key(key)
    if tenant is not None:
        return tenant
    if config.gateway.require_api_key or _has_keys(config):
        raise _unauthorized("invalid API key", "invalid_api_key")
    # No tenant has a key, so none was expected: clients that always send one (the openai SDK
    # insists on some key) still reach the keyless tenant.
    anonymous = config.anonymous_tenant()
    assert anonymous is not None, "config validation guarantees a keyless tenant when no tenant has keys"
    return anonymous


def _has_keys(config: ServerConfig) -> bool:
    return any(t.api_keys or t.api_key_sha256 for t in config.tenants)


def _unauthorized(message: str, code: str) -> APIError:
    return APIError(401, message, code=code, headers={"www-authenticate": "Bearer"})
