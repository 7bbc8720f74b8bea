"""Names and labels of the objects a service owns. Purely computational.

Kubernetes caps Service names and label values at 63 characters; a service and tier may each
be up to 63 characters long, so derived names are truncated and made unique again by a short
hash of the full name. The same inputs always give the same name, so plans are stable.
"""

from __future__ import annotations

import hashlib

from fleetpilot.api.layout import LayoutError, role_layout
from fleetpilot.api.spec import ResolvedRole, RoleName

MAX_NAME = 63
# The LeaderWorkerSet controller names a group's StatefulSet ``<lws>-<group>`` and its pods
# ``<lws>-<group>-<worker>``, and the StatefulSet controller labels pods with
# ``<statefulset>-<10-character hash>``: at most 63 characters with three-digit indexes.
MAX_SET_NAME = 45
_HASH_LEN = 8

LABEL_SERVICE = "fleetpilot.dev/service"
LABEL_TIER = "fleetpilot.dev/tier"
LABEL_ROLE = "fleetpilot.dev/role"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
MANAGER = "fleetpilot"
# Set by the LeaderWorkerSet controller on every pod of a group: 0 on the leader.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def bounded_name(*parts: str, limit: int = MAX_NAME) -> str:
    """Join parts with '-'; past the limit, truncate and append a hash of the full name."""
    full = "-".join(p for p in parts if p)
    if len(full) <= limit:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:_HASH_LEN]
    head = full[: limit - _HASH_LEN - 1].rstrip("-")
    return f"{head}-{digest}"


def engine_name(service: str, tier: str, role: str) -> str:
    """Deployment/Service name of one role of a tier: ``chat-small`` or ``chat-large-decode``."""
    return bounded_name(service, tier, "" if role == RoleName.UNIFIED else role)


def leader_worker_set_name(service: str, tier: str, role: str) -> str:
    """LeaderWorkerSet name of one role whose replicas span nodes (``engine_name`` when short)."""
    return bounded_name(service, tier, "" if role == RoleName.UNIFIED else role, limit=MAX_SET_NAME)


def leaders_service_name(service: str, tier: str, role: str) -> str:
    """The headless Service listing a multi-node role's leader pods, which serve its API: the
    LeaderWorkerSet controller makes one named as the set, for the groups' own addresses."""
    return bounded_name(leader_worker_set_name(service, tier, role), "leaders")


def spans_nodes(role: ResolvedRole) -> bool:
    """Whether a role's replicas are groups of pods on several nodes (LeaderWorkerSet groups);
    a layout the planner refuses counts as one node: it plans nothing for it."""
    try:
        return role_layout(role).multi_node
    except LayoutError:
        return False


def engine_workload(service: str, role: ResolvedRole) -> tuple[str, str]:
    """(kind, name) of the object that runs a role's replicas: a Deployment, or a
    LeaderWorkerSet when a replica spans nodes."""
    if spans_nodes(role):
        return "LeaderWorkerSet", leader_worker_set_name(service, role.tier.name, role.name)
    return "Deployment", engine_name(service, role.tier.name, role.name)


def engine_service_name(service: str, role: ResolvedRole) -> str:
    """The headless Service whose endpoints are the role's API servers (what the router
    discovers): every pod of a one-node replica, the leaders of multi-node ones."""
    if spans_nodes(role):
        return leaders_service_name(service, role.tier.name, role.name)
    return engine_name(service, role.tier.name, role.name)


def engine_service_account_name(service: str) -> str:
    """The ServiceAccount every engine pod of the service runs as (no RBAC binds it)."""
    return bounded_name(service, "engines")


def router_name(service: str) -> str:
    return bounded_name(service, "router")


def router_peers_name(service: str) -> str:
    """The headless Service through which router replicas find each other (``routing.peers``)."""
    return bounded_name(service, "router-peers")


def service_labels(service: str) -> dict[str, str]:
    """Labels every object of the service carries (selecting them finds all it owns)."""
    return {LABEL_SERVICE: service, LABEL_MANAGED_BY: MANAGER, LABEL_INSTANCE: service}


def engine_selector(service: str, tier: str, role: str) -> dict[str, str]:
    """The labels that select the engine pods of one role of a tier (immutable once created)."""
    # str(): a RoleName becomes its plain value, so objects stay plain data (YAML, JSON).
    return {LABEL_SERVICE: service, LABEL_TIER: tier, LABEL_ROLE: str(role)}


def engines_selector(service: str) -> dict[str, str]:
    """The labels that select every engine pod of the service, whatever its tier and role."""
    return {LABEL_SERVICE: service, LABEL_COMPONENT: "engine"}


def router_selector(service: str) -> dict[str, str]:
    return {LABEL_SERVICE: service, LABEL_COMPONENT: "router"}
