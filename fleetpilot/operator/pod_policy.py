"""What every pod fleetpilot plans carries: the restricted Pod Security Standard's settings and
a spread across zones and nodes. Purely computational."""

from __future__ import annotations

from fleetpilot.operator.plan_types import K8sObject

# A numeric user (runAsNonRoot can only be checked against a number): the fleetpilot images
# run as 65532 already; the vLLM image runs as root unless told otherwise.
POD_UID = 65532
ZONE_KEY = "topology.kubernetes.io/zone"
HOST_KEY = "kubernetes.io/hostname"


def pod_security() -> K8sObject:
    """The restricted standard at the pod level: no root, the runtime's seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": POD_UID,
        "runAsGroup": POD_UID,
        "fsGroup": POD_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security(*, read_only_root: bool) -> K8sObject:
    """The restricted standard at the container level: no escalation, no capabilities."""
    security: K8sObject = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    if read_only_root:
        security["readOnlyRootFilesystem"] = True
    return security


def spread(selector: dict[str, str]) -> list[K8sObject]:
    """Replicas spread over zones, then nodes - as a preference (ScheduleAnyway): GPUs are
    scarce, and a pod that cannot be spread is still better placed than left pending. Only
    the pods of one revision count (pod-template-hash), so a rollout's surge does not skew."""
    return [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector},
            "matchLabelKeys": ["pod-template-hash"],
        }
        for key in (ZONE_KEY, HOST_KEY)
    ]
