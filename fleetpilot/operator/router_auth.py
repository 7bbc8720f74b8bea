"""The router's API keys (``spec.routing.auth``): the tenants' Secrets mounted into its pods,
and the files its config reads them from. Purely computational.

Each Secret a tenant names is mounted whole-directory (never ``subPath``, which the kubelet
does not update), holding only the keys tenants name, at ``/etc/fleetpilot/auth/<secret>``: a
rotated Secret reaches the running router within the kubelet's sync period, and the router
re-reads the file when its content changes (routing.auth) - no restart, no rollout. The router
needs no right to read Secrets: the kubelet mounts them.
"""

from __future__ import annotations

from fleetpilot.api import InferenceService
from fleetpilot.api.router_config import AuthConfig, TenantKeys
from fleetpilot.api.spec import SecretKeyRef
from fleetpilot.operator.plan_types import K8sObject, PlanError

AUTH_DIR = "/etc/fleetpilot/auth"


def key_file(ref: SecretKeyRef) -> str:
    """Where the router reads a tenant's keys."""
    return f"{AUTH_DIR}/{ref.name}/{ref.key}"


def auth_config(service: InferenceService) -> AuthConfig | None:
    """The router's view of the service's tenants; None without ``routing.auth``."""
    auth = service.spec.routing.auth
    if auth is None:
        return None
    return AuthConfig(
        tenants=[
            TenantKeys(
                name=tenant.name,
                key_files=[key_file(tenant.keys_secret_ref)],
                tiers=list(tenant.tiers),
                adapters=list(tenant.adapters),
                requests_per_minute=tenant.requests_per_minute,
                tokens_per_minute=tenant.tokens_per_minute,
                weight=tenant.weight,
                priority=tenant.priority,
            )
            for tenant in auth.tenants
        ],
        router_replicas=service.spec.routing.replicas,
    )


def auth_volumes(service: InferenceService) -> tuple[list[K8sObject], list[K8sObject]]:
    """The router pod's volumes and mounts of the tenants' Secrets (none without auth)."""
    auth = service.spec.routing.auth
    if auth is None:
        return [], []
    keys: dict[str, set[str]] = {}
    for tenant in auth.tenants:
        ref = tenant.keys_secret_ref
        keys.setdefault(ref.name, set()).add(ref.key)
    volumes, mounts = [], []
    for i, (secret, secret_keys) in enumerate(sorted(keys.items())):
        volumes.append(
            {
                "name": f"auth-{i}",
                "secret": {
                    "secretName": secret,
                    "items": [{"key": key, "path": key} for key in sorted(secret_keys)],
                    # Owner-readable only: the router runs as the pod's user.
                    "defaultMode": 0o400,
                },
            }
        )
        mounts.append({"name": f"auth-{i}", "mountPath": f"{AUTH_DIR}/{secret}", "readOnly": True})
    return volumes, mounts


def check_auth(service: InferenceService) -> None:
    """Refuse tenants restricted to tiers or adapters the service does not have: a typo
    would otherwise lock a tenant out (or, for adapters, be silently meaningless)."""
    auth = service.spec.routing.auth
    if auth is None:
        return
    tiers = {tier.name for tier in service.spec.tiers}
    adapters = {adapter.name for tier in service.spec.tiers for adapter in tier.adapters}
    for i, tenant in enumerate(auth.tenants):
        field = f"spec.routing.auth.tenants[{i}]"
        for j, tier in enumerate(tenant.tiers):
            if tier not in tiers:
                raise PlanError(
                    f"{field}.tiers[{j}]",
                    f"tenant {tenant.name!r} names tier {tier!r}, which the service does not "
                    f"have (tiers: {', '.join(sorted(tiers))})",
                )
        for j, adapter in enumerate(tenant.adapters):
            if adapter not in adapters:
                raise PlanError(
                    f"{field}.adapters[{j}]",
                    f"tenant {tenant.name!r} names adapter {adapter!r}, which no tier serves",
                )
