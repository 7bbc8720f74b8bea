"""Installing the Helm chart's pieces on a test cluster, as `helm install` would.

Shared by the chart tests and the operator tests (which run the operator under the chart's
ServiceAccount and RBAC, so a call the chart does not grant fails them).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

from e2e.support import condition
from fleetpilot.kube.client import APPLY_CONTENT_TYPE, Kube, KubeError
from fleetpilot.testing.polling import eventually

Obj = dict[str, Any]

CHART = Path(__file__).resolve().parents[1] / "charts" / "fleetpilot"
MANAGER = "e2e"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
IDENTITY_KINDS = frozenset(
    {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "KopfPeering",
        "ClusterKopfPeering",
    }
)


class Discovery:
    """REST paths of rendered objects, from the API server's discovery documents."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._cache: dict[str, list[Obj]] = {}

    def resources(self, api_version: str) -> list[Obj]:
        if api_version not in self._cache:
            base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            try:
                listing = self.kube.request("GET", base)
            except KubeError as exc:
                if exc.not_found:
                    return []  # not cached: a CRD may still be on its way
                raise
            self._cache[api_version] = listing.get("resources", [])
        return self._cache[api_version]

    def path(self, obj: Obj) -> str | None:
        """The object's URL, or None when the cluster does not serve its kind."""
        api_version, kind, meta = obj["apiVersion"], obj["kind"], obj["metadata"]
        for resource in self.resources(api_version):
            if resource["kind"] == kind and "/" not in resource["name"]:
                base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
                if resource["namespaced"]:
                    base += f"/namespaces/{meta['namespace']}"
                return f"{base}/{resource['name']}/{meta['name']}"
        return None


def apply(kube: Kube, path: str, obj: Obj, *, dry_run: bool) -> Obj:
    """Server-side apply as `kubectl apply --server-side` (strict: unknown fields are errors)."""
    query = [("fieldManager", MANAGER), ("force", "true"), ("fieldValidation", "Strict")]
    if dry_run:
        query.append(("dryRun", "All"))
    return kube.request("PATCH", path, query=query, body=obj, content_type=APPLY_CONTENT_TYPE)


def install_crds(kube: Kube, chart: helm.Chart) -> None:
    """The chart's crds/ applied, Established, and their kinds in discovery."""
    install_definitions(kube, [yaml.safe_load(item["data"]) for item in chart.crds])


def install_definitions(kube: Kube, definitions: list[Obj]) -> None:
    """CustomResourceDefinitions applied, Established, and their kinds in discovery (each
    at its storage version)."""
    for definition in definitions:
        apply(kube, f"{CRD_PATH}/{definition['metadata']['name']}", definition, dry_run=False)
    for definition in definitions:
        name = definition["metadata"]["name"]

        def established(name: str = name) -> bool | None:
            state = condition(kube.request("GET", f"{CRD_PATH}/{name}"), "Established")
            return True if state and state["status"] == "True" else None

        eventually(f"CRD {name} Established", established)
        spec = definition["spec"]
        (stored,) = [v["name"] for v in spec["versions"] if v.get("storage")]
        group_version = f"{spec['group']}/{stored}"
        kind = spec["names"]["kind"]

        def discovered(group_version: str = group_version, kind: str = kind) -> bool | None:
            resources = Discovery(kube).resources(group_version)
            return True if any(r["kind"] == kind for r in resources) else None

        eventually(f"{kind} in discovery", discovered)


def render(chart: helm.Chart, values: Obj, release: str, namespace: str) -> list[Obj]:
    manifests = chart.render(values, name=release, namespace=namespace, is_install=True)
    objects: list[Obj] = []
    for path in sorted(manifests):
        if path.endswith(".yaml"):
            objects += [obj for obj in yaml.safe_load_all(manifests[path]) if obj]
    return objects


def release_name() -> str:
    """Unique per test: cluster-scoped objects (ClusterRole, ClusterKopfPeering) carry it."""
    return f"fp-{uuid.uuid4().hex[:8]}"


def install_identity(kube: Kube, objects: list[Obj]) -> list[str]:
    """Create the chart's ServiceAccount, RBAC and peering objects for real.

    Returns the paths of the cluster-scoped ones, which the caller deletes afterwards (the
    test namespace takes the rest with it).
    """
    discovery = Discovery(kube)
    cluster_scoped: list[str] = []
    for obj in objects:
        if obj["kind"] not in IDENTITY_KINDS:
            continue
        path = discovery.path(obj)
        assert path is not None, obj["kind"]
        apply(kube, path, obj, dry_run=False)
        if "namespace" not in obj["metadata"]:
            cluster_scoped.append(path)
    return cluster_scoped


def can(
    operator: Kube,
    verb: str,
    group: str,
    resource: str,
    namespace: str | None = None,
    subresource: str = "",
) -> bool:
    """The API server's RBAC answer for the caller's identity (a SelfSubjectAccessReview)."""
    attributes: Obj = {"verb": verb, "group": group, "resource": resource}
    if namespace:
        attributes["namespace"] = namespace
    if subresource:
        attributes["subresource"] = subresource
    review = operator.request(
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        body={
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        },
    )
    return bool(review["status"]["allowed"])
