"""A small, typed Kubernetes REST client for the kinds fleetpilot manages.

Why not the generated per-kind APIs: server-side apply needs a raw PATCH with
``application/apply-patch+yaml``, the planner speaks plain dicts, and with every request
passing through one method (:meth:`Kube.request`) a test can count or fake them by overriding
it (``tests/support/kube.py`` does both).
The caller runs it in a thread (kopf runs sync handlers in an executor), never in the loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s

Obj = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the REST API."""

    api_version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        return f"{base}/{name}" if name else base


RESOURCES: dict[str, Resource] = {
    "Deployment": Resource("apps/v1", "deployments"),
    "Service": Resource("v1", "services"),
    "ConfigMap": Resource("v1", "configmaps"),
    "ServiceAccount": Resource("v1", "serviceaccounts"),
    "Pod": Resource("v1", "pods"),
    "Event": Resource("v1", "events"),
    "Role": Resource("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": Resource("rbac.authorization.k8s.io/v1", "rolebindings"),
    "PodDisruptionBudget": Resource("policy/v1", "poddisruptionbudgets"),
    "PersistentVolumeClaim": Resource("v1", "persistentvolumeclaims"),
    "Job": Resource("batch/v1", "jobs"),
    "NetworkPolicy": Resource("networking.k8s.io/v1", "networkpolicies"),
    "PodMonitor": Resource("monitoring.coreos.com/v1", "podmonitors"),
    "LeaderWorkerSet": Resource("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "InferencePool": Resource("inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": Resource("gateway.networking.k8s.io/v1", "httproutes"),
    "InferenceService": Resource("fleetpilot.dev/v1alpha1", "inferenceservices"),
    # Read only: their allocatable memory bounds an engine pod's (operator.node_memory).
    "Node": Resource("v1", "nodes", namespaced=False),
}

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"


def parse_server_version(info: Obj) -> tuple[int, int] | None:
    """major.minor of a ``/version`` answer; managed clusters write minor as "35+"."""
    try:
        return int(str(info.get("major", ""))), int(str(info.get("minor", "")).rstrip("+"))
    except ValueError:
        return None


class KubeError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        self.status = status
        try:
            self.details: Obj = json.loads(body)
        except ValueError:
            self.details = {}
        message = self.details.get("message") or body[:500]
        super().__init__(f"{method} {path}: {status} {message}")

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def retryable(self) -> bool:
        """Conflicts, throttling and server-side trouble pass; other 4xx will not."""
        return self.status in (409, 429) or self.status >= 500


class Kube:
    """REST access through a configured ``kubernetes.client.ApiClient``."""

    def __init__(self, api: k8s.ApiClient, timeout_s: float = 30.0) -> None:
        self.api = api
        self.timeout_s = timeout_s

    def request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Obj | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        text = self._send(method, path, query=query, body=body, content_type=content_type)
        return json.loads(text) if text else {}

    def _send(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Obj | None = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> str:
        """The answer's body as text; KubeError for a non-2xx status."""
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type
        _, url, headers, body_out, _ = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(
            method, url, header_params=headers, body=body_out, _request_timeout=self.timeout_s
        )
        raw: bytes = response.read()  # type: ignore[no-untyped-call]
        text = raw.decode("utf-8") if raw else ""
        if response.status >= 400:
            raise KubeError(response.status, method, path, text)
        return text

    # -- reads ------------------------------------------------------------------------------
    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        try:
            return self.request("GET", RESOURCES[kind].path(namespace, name))
        except KubeError as exc:
            if exc.not_found:
                return None
            raise

    def list_cluster(self, kind: str, *, cached: bool = False) -> list[Obj]:
        """Every object of a cluster-scoped kind (Nodes). ``cached``: as the API server's
        watch cache holds them (``resourceVersion=0``: no read of etcd, at most a moment
        behind), for a periodic read of a large list."""
        query = [("resourceVersion", "0")] if cached else []
        result = self.request("GET", RESOURCES[kind].path(), query=query)
        items: list[Obj] = result.get("items", [])
        for item in items:
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", RESOURCES[kind].api_version)
        return items

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Obj]:
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in sorted(selector.items())))]
        result = self.request("GET", RESOURCES[kind].path(namespace), query=query)
        items: list[Obj] = result.get("items", [])
        for item in items:  # list items omit these; callers compare whole objects
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", RESOURCES[kind].api_version)
        return items

    def pod_log(self, namespace: str, name: str, tail_lines: int) -> str | None:
        """The last ``tail_lines`` lines of a one-container pod's log; None when the server has
        none to give (no such pod, or one not started on a node yet)."""
        path = RESOURCES["Pod"].path(namespace, name) + "/log"
        query = [("tailLines", str(tail_lines))]
        try:
            return self._send("GET", path, query=query, accept="text/plain, */*")
        except KubeError as exc:
            if exc.status in (400, 404):  # 400: "pod ... does not have a host assigned"
                return None
            raise

    def serves(self, api_version: str, plural: str) -> bool:
        """Whether the cluster serves a resource (optional CRDs: PodMonitor, ...)."""
        try:
            listing = self.request("GET", f"/apis/{api_version}")
        except KubeError as exc:
            if exc.not_found:
                return False
            raise
        return any(r.get("name") == plural for r in listing.get("resources", []))

    def server_version(self) -> tuple[int, int] | None:
        """The API server's major.minor (``/version``); None when it does not say in numbers."""
        info = self.request("GET", "/version")
        return parse_server_version(info)

    # -- writes -----------------------------------------------------------------------------
    def apply(self, obj: Obj, manager: str, *, force: bool = True) -> Obj:
        """Server-side apply: the server merges, tracking which manager owns which field."""
        meta = obj["metadata"]
        path = RESOURCES[obj["kind"]].path(meta.get("namespace"), meta["name"])
        query = [("fieldManager", manager)]
        if force:
            query.append(("force", "true"))
        return self.request("PATCH", path, query=query, body=obj, content_type=APPLY_CONTENT_TYPE)

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        try:
            self.request(
                "DELETE",
                RESOURCES[kind].path(namespace, name),
                body={"propagationPolicy": "Background"},
            )
        except KubeError as exc:
            if exc.not_found:
                return False
            raise
        return True

    def patch_status(
        self,
        kind: str,
        namespace: str,
        name: str,
        status: Obj,
        manager: str,
        *,
        resource_version: str | None = None,
    ) -> Obj:
        """Merge-patch the status subresource; with ``resource_version`` the server refuses
        (409) a write to an object changed since that version."""
        body: Obj = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return self.request(
            "PATCH",
            RESOURCES[kind].path(namespace, name) + "/status",
            query=[("fieldManager", manager)],
            body=body,
            content_type=MERGE_CONTENT_TYPE,
        )

    def create(self, obj: Obj, manager: str) -> Obj:
        meta = obj["metadata"]
        path = RESOURCES[obj["kind"]].path(meta.get("namespace"))
        return self.request("POST", path, query=[("fieldManager", manager)], body=obj)
