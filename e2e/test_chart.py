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
from typing import Any

import helm_python as helm
import pytest

from e2e.chart_support import (
    Discovery,
    apply,
    can,
    install_identity,
    release_name,
    render,
)
from fleetpilot.kube.client import MERGE_CONTENT_TYPE, Kube
from fleetpilot.operator.plan_types import PlanOptions
from fleetpilot.operator.planner import plan
from fleetpilot.testing.cluster import Cluster
from fleetpilot.testing.polling import eventually
from tests.factories import make_service, make_tier

pytestmark = pytest.mark.cluster

# Kinds whose API may be absent from the cluster under test (the Prometheus Operator's CRDs
# are optional for fleetpilot); every other kind must be served.
OPTIONAL_KINDS = {"PodMonitor"}

Obj = dict[str, Any]


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
    created: list[str] = []
    try:
        created = install_identity(kube, objects)
        account = next(o for o in objects if o["kind"] == "ServiceAccount")["metadata"]["name"]
        peering = next(o for o in objects if o["kind"].endswith("KopfPeering"))["metadata"]["name"]
        yield Installed(f"system:serviceaccount:{namespace}:{account}", peering, cluster_wide)
    finally:
        for path in created:
            kube.request("DELETE", path)


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
            # Nodes' allocatable memory, which engine pods are checked against (either scope).
            ("list", "", "nodes", None, ""),
            ("get", "", "nodes", None, ""),
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
