"""identify(): the table of key / tier cases, against configs with and without keys."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from starlette.datastructures import Headers

from gateway.errors import APIError
from gateway.identity import identify, with_cache_salt, with_service_tier
from wire.config import GatewayConfig, ServerConfig, Tenant
from wire.tier import Tier

KEYED = ServerConfig(
    tenants=(
        Tenant(name="chat", api_keys=("chat-key",), default_tier="interactive"),
        Tenant(
            name="jobs",
            api_key_sha256=(hashlib.sha256(b"jobs-key").hexdigest(),),
            default_tier="batch",
            max_tier="standard",
        ),
        Tenant(name="anonymous", max_tier="batch", default_tier="batch"),
    )
)
REQUIRED = msgspec.structs.replace(
    KEYED, gateway=GatewayConfig(require_api_key=True), tenants=KEYED.tenants[:2]
)
KEYLESS = ServerConfig()  # one keyless tenant, no keys anywhere


def headers(key: str | None = None, tier: str | None = None, authorization: str | None = None) -> Headers:
    raw: dict[str, str] = {}
    if key is not None:
        raw["Authorization"] = f"Bearer {key}"
    if authorization is not None:
        raw["Authorization"] = authorization
    if tier is not None:
        raw["X-SLA-Tier"] = tier
    return Headers(raw)


OK_CASES = [
    # (id, config, headers, tenant, tier)
    ("key, tenant default", KEYED, headers("chat-key"), "chat", "interactive"),
    ("key, lower tier asked", KEYED, headers("chat-key", "batch"), "chat", "batch"),
    ("hashed key, default", KEYED, headers("jobs-key"), "jobs", "batch"),
    ("hashed key, up to max", KEYED, headers("jobs-key", "standard"), "jobs", "standard"),
    ("scheme any case", KEYED, headers(authorization="bearer chat-key"), "chat", "interactive"),
    ("blank tier header = none", KEYED, headers("jobs-key", "  "), "jobs", "batch"),
    ("no key, anonymous", KEYED, headers(), "anonymous", "batch"),
    ("required, key", REQUIRED, headers("chat-key", "standard"), "chat", "standard"),
    ("keyless config, no key", KEYLESS, headers(), "anonymous", "standard"),
    ("keyless config ignores a key", KEYLESS, headers("whatever", "interactive"), "anonymous", "interactive"),
]


@pytest.mark.parametrize(
    ("config", "given", "tenant", "tier"), [c[1:] for c in OK_CASES], ids=[c[0] for c in OK_CASES]
)
def test_resolves(config: ServerConfig, given: Headers, tenant: str, tier: str) -> None:
    identity = identify(config, given)
    assert (identity.tenant.name, identity.tier.name) == (tenant, tier)
    assert identity.tier == config.tier(tier)


ERROR_CASES = [
    # (id, config, headers, status, type, param, code)
    ("required, no key", REQUIRED, headers(), 401, "authentication_error", None, "missing_api_key"),
    ("wrong key", KEYED, headers("nope"), 401, "authentication_error", None, "invalid_api_key"),
    ("required, wrong key", REQUIRED, headers("nope"), 401, "authentication_error", None, "invalid_api_key"),
    ("empty bearer", KEYED, headers(""), 401, "authentication_error", None, "invalid_api_key"),
    ("not bearer", KEYED, headers(authorization="Basic Y2hhdC1rZXk="), 401, "authentication_error", None,
     "invalid_api_key"),
    ("above max", KEYED, headers("jobs-key", "interactive"), 403, "permission_error", "X-SLA-Tier",
     "tier_not_allowed"),
    ("anonymous above max", KEYED, headers(tier="standard"), 403, "permission_error", "X-SLA-Tier",
     "tier_not_allowed"),
    ("unknown tier", KEYED, headers("chat-key", "gold"), 400, "invalid_request_error", "X-SLA-Tier",
     "unknown_tier"),
    # The key is checked first: a bad key learns nothing about tiers.
    ("wrong key and unknown tier", KEYED, headers("nope", "gold"), 401, "authentication_error", None,
     "invalid_api_key"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("config", "given", "status", "kind", "param", "code"),
    [c[1:] for c in ERROR_CASES],
    ids=[c[0] for c in ERROR_CASES],
)
def test_refuses(
    config: ServerConfig, given: Headers, status: int, kind: str, param: str | None, code: str
) -> None:
    with pytest.raises(APIError) as caught:
        identify(config, given)
    error = caught.value
    body = error.body().error
    assert (error.status, body.type, body.param, body.code) == (status, kind, param, code)
    if status == 401:
        assert error.response().headers["www-authenticate"] == "Bearer"
    assert "nope" not in body.message and "chat-key" not in body.message  # never echoes a key


def test_the_cache_salt_is_the_tenants_under_the_server_secret() -> None:
    chat = identify(KEYED, headers("chat-key"))
    jobs = identify(KEYED, headers("jobs-key"))
    assert chat.cache_salt != jobs.cache_salt
    assert identify(KEYED, headers("chat-key", tier="batch")).cache_salt == chat.cache_salt
    # Nothing a client sends chooses it: it follows the tenant only.
    sneaky = Headers({"Authorization": "Bearer chat-key", "X-Cache-Salt": "jobs", "X-SLA-Tier": "standard"})
    assert identify(KEYED, sneaky).cache_salt == chat.cache_salt
    # A configured secret makes it stable across gateways; another secret gives another salt.
    a = msgspec.structs.replace(KEYED, gateway=GatewayConfig(cache_salt_secret="s3cret"))
    b = msgspec.structs.replace(KEYED, gateway=GatewayConfig(cache_salt_secret="other"))
    assert identify(a, headers("chat-key")).cache_salt == identify(a, headers("chat-key")).cache_salt
    assert identify(a, headers("chat-key")).cache_salt != identify(b, headers("chat-key")).cache_salt
    assert len(chat.cache_salt) == 32


def test_a_requests_cache_salt_narrows_its_tenants() -> None:
    """vLLM's ``cache_salt``: the same salt within a tenant, the same blocks; another salt, or another
    tenant sending the same salt, other blocks; empty or overlong, a 400 naming it."""
    chat = identify(KEYED, headers("chat-key"))
    jobs = identify(KEYED, headers("jobs-key"))
    salted = with_cache_salt(chat, "team-a")
    assert with_cache_salt(chat, None) == chat and with_cache_salt(chat, "team-a") == salted
    salts = {chat.cache_salt, salted.cache_salt, with_cache_salt(chat, "team-b").cache_salt}
    assert len(salts | {with_cache_salt(jobs, "team-a").cache_salt}) == 4
    assert len(salted.cache_salt) == 32
    for bad in ("", "x" * 257):
        with pytest.raises(APIError) as info:
            with_cache_salt(chat, bad)
        assert (info.value.status, info.value.param) == (400, "cache_salt")


SERVICE_TIER_CASES = [
    # (id, headers, service_tier, tier) against KEYED
    ("absent: the tenant's default", headers("chat-key"), None, "interactive"),
    ("auto: the header's or the default", headers("chat-key", "standard"), "auto", "standard"),
    ("flex: the least urgent", headers("chat-key"), "flex", "batch"),
    ("default: the server's default tier", headers("chat-key"), "default", "standard"),
    ("priority: the most urgent", headers("chat-key"), "priority", "interactive"),
    ("the header's own tier again", headers("jobs-key", "batch"), "flex", "batch"),
]


@pytest.mark.parametrize(
    ("given", "service_tier", "tier"),
    [c[1:] for c in SERVICE_TIER_CASES],
    ids=[c[0] for c in SERVICE_TIER_CASES],
)
def test_service_tier_picks_the_tier(given: Headers, service_tier: str | None, tier: str) -> None:
    identity = with_service_tier(KEYED, identify(KEYED, given), service_tier)
    assert identity.tier.name == tier


@pytest.mark.parametrize(
    ("given", "service_tier", "status", "code"),
    [
        (headers("chat-key"), "scale", 400, "unknown_tier"),  # not mapped by default
        (headers("chat-key"), "fast", 400, "unknown_tier"),
        (headers("chat-key", "batch"), "priority", 400, "conflicting_tier"),
        (headers("jobs-key"), "priority", 403, "tier_not_allowed"),  # above its max_tier, as the header
    ],
)
def test_service_tier_refuses(given: Headers, service_tier: str, status: int, code: str) -> None:
    with pytest.raises(APIError) as raised:
        with_service_tier(KEYED, identify(KEYED, given), service_tier)
    assert (raised.value.status, raised.value.code, raised.value.param) == (status, code, "service_tier")
    assert repr(service_tier) in raised.value.message  # the value the client sent, named back


def test_service_tiers_follow_the_config_and_name_the_tier_back() -> None:
    custom = ServerConfig(
        tiers=(Tier(name="now", rank=0), Tier(name="soon", rank=1), Tier(name="later", rank=2)),
        default_tier="soon",
    )
    assert custom.service_tier_map() == {"priority": "now", "default": "soon", "flex": "later"}
    mapped = msgspec.structs.replace(custom, service_tiers={"scale": "now", "default": "later"})
    assert mapped.service_tier("scale").name == "now"
    with pytest.raises(KeyError, match="served: auto, default, scale"):
        mapped.service_tier("flex")
    assert [mapped.service_tier_name(t) for t in mapped.tiers] == ["scale", None, "default"]
    assert [KEYLESS.service_tier_name(t) for t in KEYLESS.tiers_by_urgency] == ["priority", "default", "flex"]
