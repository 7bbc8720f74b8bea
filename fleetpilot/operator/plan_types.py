"""Plain data shared by the planner's modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetpilot import __version__
from fleetpilot.api import InferenceService

K8sObject = dict[str, Any]

# The router and operator ship in one image, tagged with the package version it was built from.
DEFAULT_FLEETPILOT_IMAGE = f"ghcr.io/fleetpilot/fleetpilot:{__version__}"


class PlanError(ValueError):
    """A spec the API server accepts but the planner cannot realize; names the field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class PlanOptions:
    """What the planner may assume about the cluster it plans for."""

    fleetpilot_image: str = DEFAULT_FLEETPILOT_IMAGE
    pod_monitor_available: bool = False
    # Where the operator's own pods run ($POD_NAMESPACE from the chart): engines that load
    # adapters at run time admit its calls from there (network_policy). None: any namespace.
    operator_namespace: str | None = None
    # Image volumes (an OCI model source's `mount: auto`): on by default from Kubernetes 1.35;
    # the operator sets this from the API server's version.
    image_volumes: bool = True


def owner_references(service: InferenceService) -> list[K8sObject]:
    """Make every planned object garbage-collected with its service (needs the server's uid)."""
    if not service.metadata.uid:
        return []
    return [
        {
            "apiVersion": service.api_version,
            "kind": service.kind,
            "name": service.name,
            "uid": service.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def object_meta(service: InferenceService, name: str, labels: dict[str, str]) -> K8sObject:
    meta: K8sObject = {"name": name, "namespace": service.namespace, "labels": labels}
    owners = owner_references(service)
    if owners:
        meta["ownerReferences"] = owners
    return meta
