"""Plain data shared by the planner's modules. No I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fleetpilot import __version__
from fleetpilot.api import InferenceService, ResolvedRole
from fleetpilot.api.capacity import RoleCapacity, role_capacity

K8sObject = dict[str, Any]

# The router and operator ship in one image, tagged with the package version it was built from.
DEFAULT_FLEETPILOT_IMAGE = f"ghcr.io/fleetpilot/fleetpilot:{__version__}"
# The CPU reference engine of a tier with engine.backend reference: the fleetpilot image has no
# torch (engine_image/Dockerfile.operator), this one is the package with its engine extra
# (engine_image/Dockerfile.reference), tagged with the same version so the engine speaks the
# operator's and router's contract.
DEFAULT_REFERENCE_IMAGE = f"ghcr.io/fleetpilot/fleetpilot-reference:{__version__}"


# Condition (and Event) reasons of a refused plan: what the status says is in the way.
PLAN_REFUSED = "PlanRefused"  # the spec asks for what fleetpilot cannot run
# The spec is fine, the cluster lacks the LeaderWorkerSet API its multi-node roles run on.
LEADER_WORKER_SET_MISSING = "LeaderWorkerSetMissing"


@dataclass(frozen=True)
class Refusal:
    """Why a service's spec was not realized: a condition reason and the words saying what to
    change. The status reports it as Ready False, Degraded and Stalled True."""

    message: str
    reason: str = PLAN_REFUSED


class PlanError(ValueError):
    """A spec the API server accepts but the planner cannot realize; names the field, and
    with ``reason`` says what kind of obstacle it is (the status's condition reason)."""

    def __init__(self, field: str, message: str, reason: str = PLAN_REFUSED) -> None:
        self.field = field
        self.message = message
        self.reason = reason
        super().__init__(f"{field}: {message}")

    @property
    def refusal(self) -> Refusal:
        return Refusal(str(self), self.reason)


@dataclass(frozen=True)
class PlanOptions:
    """What the planner may assume about the cluster it plans for."""

    fleetpilot_image: str = DEFAULT_FLEETPILOT_IMAGE
    reference_image: str = DEFAULT_REFERENCE_IMAGE
    pod_monitor_available: bool = False
    # LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) runs replicas that span nodes; without it
    # such a role is refused. Assumed served when planning offline (fleetpilot plan).
    leader_worker_set_available: bool = True
    # The Gateway API Inference Extension's InferencePool and the Gateway API's HTTPRoute
    # (``routing.gateway``): planned only where served, the status saying what is missing.
    # Assumed served when planning offline.
    inference_pools_available: bool = True
    http_routes_available: bool = True
    # Where the operator's own pods run ($POD_NAMESPACE from the chart): engines that load
    # adapters at run time admit its calls from there (network_policy). None: any namespace.
    operator_namespace: str | None = None
    # Image volumes (an OCI model source's `mount: auto`): on by default from Kubernetes 1.35;
    # the operator sets this from the API server's version.
    image_volumes: bool = True
    # The most allocatable memory of a node that can run an engine pod, in bytes: a pod asking
    # for more (resources.memory and a host KV tier, engine.kvOffload) would never be
    # scheduled, so its role is refused. None: unknown, not checked (`fleetpilot plan
    # --node-memory` sets it; the operator, the largest of the cluster's nodes).
    node_memory: int | None = None
    # The same by GPU product (the nodes' nvidia.com/gpu.product label), for the engine pods
    # of a tier with resources.gpuProduct, which only such nodes take; a product no node
    # carries is not checked. None: not known by product (node_memory applies to every
    # tier). The operator reads both from the cluster's Nodes (operator.node_memory).
    node_memory_by_product: Mapping[str, int] | None = None


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


@dataclass(frozen=True)
class JobComplete:
    """A Job of the plan (a model download) has completed."""

    job: str

    def __str__(self) -> str:
        return f"Job {self.job}"


@dataclass(frozen=True)
class RolledOut:
    """An engine workload of the plan (a Deployment, or a LeaderWorkerSet) is as planned and
    rolled out: no pod of an older template left."""

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


Dependency = JobComplete | RolledOut


@dataclass(frozen=True)
class Planned:
    """One planned object and what must hold before it is applied (planned before it). A
    held object that exists already is left as it is: an engine keeps serving the revision it
    has until the new one is downloaded."""

    obj: K8sObject
    waits_for: tuple[Dependency, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return self.obj["kind"], self.obj["metadata"]["name"]


@dataclass(frozen=True)
class Download:
    """One download of the model cache: its Job, and what it fetches, for people
    (``repo@revision``, ``s3://bucket/prefix``)."""

    job: str
    what: str


@dataclass(frozen=True)
class ServicePlan:
    """What a pass of the operator knows from planning a service once: the objects with what
    each waits for, or why none (``refusal``); and what the status reports either way - the
    model cache's downloads (ModelReady) and each role's sizing (CapacitySufficient), by
    (tier, role)."""

    objects: tuple[Planned, ...]
    downloads: tuple[Download, ...]
    capacities: Capacities
    refusal: Refusal | None = None

    def outline(self) -> ServicePlan:
        """The plan less its objects' bodies (their kind and name kept, with what each waits
        for): all a status refresh reads of it, a few hundred bytes to keep per service."""
        stubs = tuple(
            Planned({"kind": item.key[0], "metadata": {"name": item.key[1]}}, item.waits_for)
            for item in self.objects
        )
        return replace(self, objects=stubs)


# Each role sized once per plan (api.capacity), by (tier name, role name): the planner's
# check, the router's prefix index and the status's CapacitySufficient all read it.
Capacities = Mapping[tuple[str, str], "RoleCapacity | None"]


def capacity_key(role: ResolvedRole) -> tuple[str, str]:
    return role.tier.name, role.name.value


def role_capacities(service: InferenceService) -> dict[tuple[str, str], RoleCapacity | None]:
    """Every role of the service sized (None where it cannot be: api.capacity)."""
    return {
        capacity_key(role): role_capacity(role)
        for tier in service.spec.tiers
        for role in tier.roles()
    }


def sized(capacities: Capacities | None, role: ResolvedRole) -> RoleCapacity | None:
    """The role's sizing from ``capacities``, else computed now."""
    if capacities is None:
        return role_capacity(role)
    return capacities[capacity_key(role)]
