"""routing.auth in the plan: the tenants' Secrets mounted into the router, its config reading
them from there, and tenants naming tiers or adapters the service lacks refused."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from fleetpilot.api import parse_service
from fleetpilot.api.router_config import ROUTER_CONFIG_FILE, RouterConfig
from fleetpilot.operator.plan_types import K8sObject, PlanError
from fleetpilot.operator.planner import plan
from tests.factories import make_manifest, make_tier

TENANTS = [
    {"name": "team-a", "keysSecretRef": {"name": "api-keys", "key": "team-a"}, "tiers": ["small"]},
    {
        "name": "team-b",
        "keysSecretRef": {"name": "api-keys", "key": "team-b"},
        "requestsPerMinute": 600,
        "tokensPerMinute": 200000,
    },
    {"name": "ops", "keysSecretRef": {"name": "ops-keys"}, "adapters": ["sql"]},
]


def _planned(tenants: list[dict[str, Any]]) -> list[K8sObject]:
    small = make_tier(
        "small",
        up_to=0.5,
        adapters=[{"name": "sql", "source": {"pvc": {"claimName": "l", "path": "s"}}}],
    )
    manifest = make_manifest(
        tiers=[small, make_tier("large")], routing={"auth": {"tenants": tenants}}
    )
    return plan(parse_service(manifest))


def _router(objects: list[K8sObject]) -> tuple[K8sObject, RouterConfig]:
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "chat-router"
    ]
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    config = RouterConfig.model_validate(yaml.safe_load(config_map["data"][ROUTER_CONFIG_FILE]))
    return deployment, config


def test_each_secret_is_mounted_whole_and_the_config_reads_the_keys_there() -> None:
    """One read-only volume per Secret holding just the named keys (a directory mount, which
    the kubelet updates when the Secret changes; a subPath mount it would not), and each
    tenant's key file in the config is where its key lands."""
    deployment, config = _router(_planned(TENANTS))
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"] if v["name"].startswith("auth-")}
    assert volumes == {
        "auth-0": {
            "name": "auth-0",
            "secret": {
                "secretName": "api-keys",
                "items": [{"key": "team-a", "path": "team-a"}, {"key": "team-b", "path": "team-b"}],
                "defaultMode": 0o400,
            },
        },
        "auth-1": {
            "name": "auth-1",
            "secret": {
                "secretName": "ops-keys",
                "items": [{"key": "token", "path": "token"}],
                "defaultMode": 0o400,
            },
        },
    }
    mounts = {
        m["name"]: m for m in pod["containers"][0]["volumeMounts"] if m["name"].startswith("auth-")
    }
    assert mounts["auth-0"] == {
        "name": "auth-0",
        "mountPath": "/etc/fleetpilot/auth/api-keys",
        "readOnly": True,
    }
    assert all("subPath" not in m for m in mounts.values())
    assert config.auth is not None
    files = {t.name: t.key_files for t in config.auth.tenants}
    assert files == {
        "team-a": ["/etc/fleetpilot/auth/api-keys/team-a"],
        "team-b": ["/etc/fleetpilot/auth/api-keys/team-b"],
        "ops": ["/etc/fleetpilot/auth/ops-keys/token"],
    }
    assert config.auth.tenants[0].tiers == ["small"]
    assert config.auth.tenants[2].adapters == ["sql"]
    # Limits are the service's; each of the 2 routers admits its share of them.
    team_b = config.auth.tenants[1]
    assert (team_b.requests_per_minute, team_b.tokens_per_minute) == (600, 200000)
    assert config.auth.router_replicas == 2


def test_without_auth_nothing_is_mounted_and_every_request_is_admitted() -> None:
    deployment, config = _router(plan(parse_service(make_manifest())))
    assert config.auth is None
    assert not [
        v
        for v in deployment["spec"]["template"]["spec"]["volumes"]
        if v["name"].startswith("auth-")
    ]


@pytest.mark.parametrize(
    ("tenant", "field", "words"),
    [
        ({"tiers": ["medium"]}, "spec.routing.auth.tenants[0].tiers[0]", "tier 'medium'"),
        ({"adapters": ["legal"]}, "spec.routing.auth.tenants[0].adapters[0]", "adapter 'legal'"),
    ],
)
def test_a_tenant_naming_what_the_service_lacks_is_refused(
    tenant: dict[str, Any], field: str, words: str
) -> None:
    """A typo in a tenant's tiers would lock it out: refused at its field."""
    with pytest.raises(PlanError) as refused:
        _planned([{"name": "a", "keysSecretRef": {"name": "k"}, **tenant}])
    assert refused.value.field == field
    assert words in refused.value.message


def test_flow_control_and_the_tenants_shares_reach_the_router() -> None:
    """routing.flowControl and each tenant's weight and class are in the router's config;
    without flowControl the router answers 429 at once (no flow in its config)."""
    tenants = [
        {"name": "batch", "keysSecretRef": {"name": "k", "key": "batch"}, "weight": 0.5},
        {"name": "chat", "keysSecretRef": {"name": "k", "key": "chat"}, "priority": 2},
    ]
    manifest = make_manifest(
        routing={"auth": {"tenants": tenants}, "flowControl": {"maxWait": "10s", "maxQueued": 64}}
    )
    _, config = _router(plan(parse_service(manifest)))
    assert config.flow is not None
    assert (config.flow.max_wait.total_seconds(), config.flow.max_queued) == (10.0, 64)
    assert config.auth is not None
    assert [(t.weight, t.priority) for t in config.auth.tenants] == [(0.5, 0), (1.0, 2)]
    _, plain = _router(plan(parse_service(make_manifest())))
    assert plain.flow is None
