"""The Helm chart against a real API server.

The chart is rendered offline by the Helm engine (helm-python-sdk); its CRDs are installed as
`helm install` would (before anything else) and every other object goes through server-side
dry-run, so the API server's own validation, defaulting and admission judge it. Then the
chart's ServiceAccount and RBAC are installed for real and the operator's API calls are made
under that identity (impersonation): what it needs is allowed, what it does not is refused.

Cluster-scoped objects carry the release name, which is unique per test, so parallel runs never
share one; the ones really created are deleted afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from e2e.support import condition, eventually
from fleetpilot.operator.kube import APPLY_CONTENT_TYPE, MERGE_CONTENT_TYPE, Kube, KubeError
from fleetpilot.operator.plan_types import PlanOptions
from fleetpilot.operator.planner import plan
from fleetpilot.testing.controlplane import Cluster
from tests.factories import make_service, make_tier

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[1] / "charts" / "fleetpilot"
MANAGER = "e2e"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
# Kinds whose API may be absent from the cluster under test (the Prometheus Operator's CRDs
# are optional for fleetpilot); every other kind must be served.
OPTIONAL_KINDS = {"PodMonitor"}

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def kube(control_plane: Cluster) -> Iterator[Kube]:
    with control_plane.api_client() as api:
        yield Kube(api)


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


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


@pytest.fixture(scope="module")
def chart_crds(kube: Kube, chart: helm.Chart) -> None:
    """The chart's crds/ applied and Established, and their kinds in discovery."""
    definitions = [yaml.safe_load(item["data"]) for item in chart.crds]
    for definition in definitions:
        apply(kube, f"{CRD_PATH}/{definition['metadata']['name']}", definition, dry_run=False)

    for definition in definitions:
        name = definition["metadata"]["name"]

        def established(name: str = name) -> bool | None:
            state = condition(kube.request("GET", f"{CRD_PATH}/{name}"), "Established")
            return True if state and state["status"] == "True" else None

        eventually(f"CRD {name} Established", established)
        spec = definition["spec"]
        group_version = f"{spec['group']}/{spec['versions'][0]['name']}"
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


def non_default_values(namespace: str) -> Obj:
    return {
        "image": {"tag": "0.1.0-rc.1"},
        "watchNamespaces": [namespace],
        "peering": {"name": f"fleet-{uuid.uuid4().hex[:8]}"},
        "logFormat": "plain",
        "verbose": True,
        "healthPort": 8081,
        "serviceAccount": {"annotations": {"example.com/role": "operator"}},
        "podLabels": {"team": "ml-platform"},
        "nodeSelector": {"node-type": "cpu"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops"}],
        "imagePullSecrets": [{"name": "regcred"}],
        "metrics": {
            "port": 9191,
            "service": {"port": 8443, "annotations": {"prometheus.io/scrape": "true"}},
            "podMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}},
        },
    }


@pytest.mark.parametrize("scenario", ["default", "non-default"])
def test_api_server_accepts_every_rendered_object(
    kube: Kube, chart: helm.Chart, chart_crds: None, namespace: str, scenario: str
) -> None:
    """Server-side dry-run of every object the chart renders, default and non-default values
    (namespaced watch list, PodMonitor, custom tag): the API server's validation is final."""
    values = {} if scenario == "default" else non_default_values(namespace)
    objects = render(chart, values, release_name(), namespace)
    discovery = Discovery(kube)
    skipped: set[str] = set()
    for obj in objects:
        path = discovery.path(obj)
        if path is None:
            skipped.add(obj["kind"])
            continue
        accepted = apply(kube, path, obj, dry_run=True)
        assert accepted["metadata"]["name"] == obj["metadata"]["name"]
        assert accepted["metadata"]["labels"] == obj["metadata"]["labels"]
    assert skipped <= OPTIONAL_KINDS, f"the cluster serves no API for {skipped - OPTIONAL_KINDS}"
    kinds = {obj["kind"] for obj in objects}
    if scenario == "default":
        assert "ClusterKopfPeering" in kinds
    else:
        assert {"KopfPeering", "Role", "RoleBinding", "PodMonitor"} <= kinds


@dataclass(frozen=True)
class Installed:
    """The chart's identity objects as installed for one test."""

    user: str  # the operator's ServiceAccount as an RBAC user name
    peering: str
    cluster_wide: bool


@pytest.fixture
def installed_rbac(
    kube: Kube, chart: helm.Chart, chart_crds: None, namespace: str, request: pytest.FixtureRequest
) -> Iterator[Installed]:
    """The chart's ServiceAccount, RBAC and peering object, created for real in the test's
    namespace (cluster-wide or watching just that namespace). Cluster-scoped ones are deleted
    afterwards; the namespace takes the rest with it."""
    cluster_wide: bool = request.param
    values: Obj = {} if cluster_wide else {"watchNamespaces": [namespace]}
    objects = render(chart, values, release_name(), namespace)
    wanted = {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "KopfPeering",
        "ClusterKopfPeering",
    }
    discovery = Discovery(kube)
    created: list[str] = []
    try:
        for obj in objects:
            if obj["kind"] not in wanted:
                continue
            path = discovery.path(obj)
            assert path is not None, obj["kind"]
            apply(kube, path, obj, dry_run=False)
            if "namespace" not in obj["metadata"]:
                created.append(path)
        account = next(o for o in objects if o["kind"] == "ServiceAccount")["metadata"]["name"]
        peering = next(o for o in objects if o["kind"].endswith("KopfPeering"))["metadata"]["name"]
        yield Installed(f"system:serviceaccount:{namespace}:{account}", peering, cluster_wide)
    finally:
        for path in created:
            kube.request("DELETE", path)


def can(
    operator: Kube,
    verb: str,
    group: str,
    resource: str,
    namespace: str | None = None,
    subresource: str = "",
) -> bool:
    """The API server's RBAC answer for the operator's identity (a SelfSubjectAccessReview)."""
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


@pytest.mark.parametrize(
    "installed_rbac", [True, False], ids=["cluster-wide", "namespaced"], indirect=True
)
def test_chart_rbac_allows_the_operator_and_nothing_else(
    control_plane: Cluster, namespace: str, installed_rbac: Installed
) -> None:
    """Under the chart's ServiceAccount (impersonated): every object a plan contains can be
    server-side applied (Roles included, past RBAC escalation prevention), kopf's peering
    keep-alive and Events go through, kopf's watches are allowed; Secrets, updates, deletes of
    InferenceServices, the other peering kind and (namespaced) other namespaces are refused."""
    with control_plane.api_client() as api:
        api.set_default_header("Impersonate-User", installed_rbac.user)
        operator = Kube(api)
        # The authorizer reads RBAC from an informer cache: wait for the new bindings.
        eventually(
            "RBAC for the operator",
            lambda: can(operator, "list", "", "pods", namespace) or None,
        )

        # Every object the reconciler applies, as it applies it (a PATCH that creates), in
        # plan order. Roles are stored for real: the check on a RoleBinding (the binder must
        # hold what the Role grants) reads the Role, which a dry-run would not have stored.
        service = make_service(
            namespace=namespace,
            tiers=[make_tier("small", up_to=0.4), make_tier("large", mode="disaggregated")],
        )
        discovery = Discovery(operator)
        for obj in plan(service, PlanOptions()):
            path = discovery.path(obj)
            assert path is not None, obj["kind"]
            apply(operator, path, obj, dry_run=obj["kind"] != "Role")

        # kopf's keep-alive: a merge patch of the peering object's status.
        if installed_rbac.cluster_wide:
            peering = f"/apis/kopf.dev/v1/clusterkopfpeerings/{installed_rbac.peering}"
            other_peering: tuple[str, str | None] = ("kopfpeerings", namespace)
        else:
            peering = (
                f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings/{installed_rbac.peering}"
            )
            other_peering = ("clusterkopfpeerings", None)
        operator.request(
            "PATCH",
            peering,
            query=[("dryRun", "All")],
            body={"status": {"e2e@test": {"priority": 0, "lifetime": 60}}},
            content_type=MERGE_CONTENT_TYPE,
        )
        # kopf's Events on an InferenceService.
        operator.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/events",
            query=[("dryRun", "All")],
            body={
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": "chat.", "namespace": namespace},
                "involvedObject": {
                    "apiVersion": "fleetpilot.dev/v1alpha1",
                    "kind": "InferenceService",
                    "name": "chat",
                    "namespace": namespace,
                },
                "reason": "Created",
                "message": "created",
                "type": "Normal",
            },
        )

        granted = [
            ("list", "apiextensions.k8s.io", "customresourcedefinitions", None, ""),
            ("watch", "apiextensions.k8s.io", "customresourcedefinitions", None, ""),
            ("watch", "fleetpilot.dev", "inferenceservices", namespace, ""),
            ("patch", "fleetpilot.dev", "inferenceservices", namespace, ""),
            ("patch", "fleetpilot.dev", "inferenceservices", namespace, "status"),
            ("watch", "apps", "deployments", namespace, ""),
            ("delete", "apps", "deployments", namespace, ""),
            ("patch", "apps", "deployments", namespace, "scale"),
            ("watch", "", "pods", namespace, ""),
            ("watch", "discovery.k8s.io", "endpointslices", namespace, ""),
        ]
        refused = [
            ("get", "", "secrets", namespace, ""),
            ("update", "apps", "deployments", namespace, ""),
            ("delete", "fleetpilot.dev", "inferenceservices", namespace, ""),
            ("escalate", "rbac.authorization.k8s.io", "roles", namespace, ""),
            ("list", "rbac.authorization.k8s.io", "clusterroles", None, ""),
            ("patch", "kopf.dev", *other_peering, ""),
        ]
        # kopf reads namespaces only when serving a list of them.
        namespaces = [("list", "", "namespaces", None, ""), ("watch", "", "namespaces", None, "")]
        if installed_rbac.cluster_wide:
            refused += namespaces
        else:
            granted += namespaces
            refused.append(("list", "apps", "deployments", "default", ""))
        for verb, group, resource, where, sub in granted:
            assert can(operator, verb, group, resource, where, sub), (verb, resource, sub)
        for verb, group, resource, where, sub in refused:
            assert not can(operator, verb, group, resource, where, sub), (verb, resource, where)
