"""Each service's workloads and pods as the operator's watches deliver them (kopf indexes).

A status is computed from the service's workloads (Deployments, and LeaderWorkerSets where the
cluster serves them: a multi-node role's) and pods. Listing them for every status
refresh (two LISTs by label, each scanning the namespace on the API server) was most of the
operator's requests while a thousand services rolled out, and listing them again right after a
reconcile applied the Deployments another two. kopf already watches these kinds (their events
trigger the refreshes); its indexes keep, per service, the few fields the status reads.

Why they can be trusted: kopf runs no handler until every index has taken in its kind's initial
listing, then keeps it current from the same watch stream, dropping an object's entry on its
deletion. The one gap is kopf's too: a deletion that happens while a watch is re-established is
seen only as the object missing from the new listing. A reconcile (every spec change, and every
service at each start) still lists the children it diffs and prunes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleetpilot.kube import names
from fleetpilot.kube.client import Obj
from fleetpilot.operator.status import Observed

ServiceKey = tuple[str, str]  # (namespace, service name)

# kopf passes each index to handlers as a keyword argument named by its id.
DEPLOYMENTS_INDEX = "deployments_by_service"
PODS_INDEX = "pods_by_service"
# Registered only where the cluster serves LeaderWorkerSet (operator.handlers).
LEADER_WORKER_SETS_INDEX = "leader_worker_sets_by_service"
# The kinds whose index entries are workloads (the rest are pods).
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")


def _pick(obj: Mapping[str, Any], *paths: tuple[str, ...]) -> Obj:
    """A copy of ``obj`` holding only the values at ``paths`` (those present)."""
    out: Obj = {}
    for path in paths:
        value: Any = obj
        for part in path:
            if not isinstance(value, Mapping) or part not in value:
                break
            value = value[part]
        else:
            target = out
            for part in path[:-1]:
                target = target.setdefault(part, {})
            target[path[-1]] = plain(value)
    return out


def plain(value: Any) -> Any:
    """A plain, independent copy of ``value``: kopf's bodies (and the mappings in them) are
    read-only views, and the reconciler, the ticker and the indexes keep plain dicts."""
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def index_entry(kind: str, body: Mapping[str, Any]) -> dict[ServiceKey, Obj]:
    """What an index keeps of one workload (Deployment, LeaderWorkerSet) or pod: the fields
    compute_status reads, under its service's key; nothing for an object of no service (kopf
    then drops any entry)."""
    metadata = body.get("metadata", {})
    service = (metadata.get("labels") or {}).get(names.LABEL_SERVICE)
    namespace = metadata.get("namespace")
    if not service or not namespace:
        return {}
    if kind in WORKLOAD_KINDS:
        kept = _pick(
            body,
            ("metadata", "name"),
            ("metadata", "generation"),
            ("spec", "replicas"),
            ("status",),
        )
    else:
        kept = _pick(
            body,
            ("metadata", "name"),
            # What the cold-start samples read (operator.cold_start): whose engine it is (and
            # whether it is a multi-node group's worker, not its leader), and since when it
            # exists or is going away.
            ("metadata", "labels", names.LABEL_TIER),
            ("metadata", "labels", names.LABEL_ROLE),
            ("metadata", "labels", names.LWS_WORKER_INDEX_LABEL),
            ("metadata", "creationTimestamp"),
            ("metadata", "deletionTimestamp"),
            ("status", "phase"),
            ("status", "conditions"),
            ("status", "containerStatuses"),
        )
    kept["kind"] = kind
    return {(namespace, service): kept}


class Children:
    """The indexes, once kopf hands them to a handler, read from any thread."""

    def __init__(self) -> None:
        self._deployments: Mapping[ServiceKey, Any] | None = None
        self._pods: Mapping[ServiceKey, Any] | None = None
        self._leader_worker_sets: Mapping[ServiceKey, Any] = {}

    def attach(
        self,
        deployments: Mapping[ServiceKey, Any],
        pods: Mapping[ServiceKey, Any],
        leader_worker_sets: Mapping[ServiceKey, Any] | None = None,
    ) -> None:
        """kopf's indexes; ``leader_worker_sets`` None where the cluster serves no
        LeaderWorkerSet (no such index is registered: the service has none)."""
        self._leader_worker_sets = leader_worker_sets if leader_worker_sets is not None else {}
        self._deployments, self._pods = deployments, pods

    @staticmethod
    def _entries(index: Mapping[ServiceKey, Any], key: ServiceKey) -> list[Obj]:
        store = index.get(key)
        # One C-level copy of the store's values: no other Python thread runs during it, so
        # it never sees the event loop's thread half-way through changing the store.
        return [*store] if store is not None else []

    def observed(self, namespace: str, service: str) -> Observed | None:
        """The service's children as last watched; None before kopf has handed over the
        indexes (the caller lists them instead)."""
        if self._deployments is None or self._pods is None:
            return None
        key = (namespace, service)
        workloads = {
            (w["kind"], w["metadata"]["name"]): w
            for index in (self._deployments, self._leader_worker_sets)
            for w in self._entries(index, key)
        }
        return Observed(workloads=workloads, pods=self._entries(self._pods, key))
