"""The Helm chart, rendered offline by the Helm engine itself (helm-python-sdk, Helm 4).

Every rendered object is checked against the Kubernetes 1.36 OpenAPI schemas; the operator's
arguments are parsed by fleetpilot's own CLI; the RBAC rules are compared with a table written
here (so a change to what the operator may do is always deliberate) and with the API calls the
operator code makes. e2e/test_chart.py sends the same objects to a real API server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest

from fleetpilot import __version__
from fleetpilot.cli import build_parser
from fleetpilot.kube import names
from fleetpilot.kube.client import RESOURCES
from fleetpilot.operator import metrics as operator_metrics
from fleetpilot.operator.network_policy import OPERATOR_POD_LABELS
from fleetpilot.operator.plan_types import DEFAULT_FLEETPILOT_IMAGE, PlanOptions
from fleetpilot.operator.planner import all_roles, plan
from fleetpilot.operator.reconcile import MANAGED_KINDS, OPTIONAL_KINDS
from tests.charts.chart_support import (
    CHART,
    K8S_VERSION,
    RELEASE,
    RELEASE_NAMESPACE,
    REPO,
    Obj,
    only,
    render,
)
from tests.factories import make_service, make_tier

DOCKERFILE = REPO / "engine_image" / "Dockerfile.operator"
FULLNAME = "fp-fleetpilot"
# Custom resources: kubernetes_validate only knows the built-in kinds. The API server checks
# these in e2e/test_chart.py (PodMonitor when the cluster has its CRD).
CUSTOM_KINDS = {"PodMonitor", "KopfPeering", "ClusterKopfPeering"}

RuleTable = dict[tuple[str, str], frozenset[str]]


def verbs(text: str) -> frozenset[str]:
    return frozenset(text.split())


# What the operator may do in every namespace it serves. Changing a line here and in
# charts/fleetpilot/templates/_helpers.tpl together is the only way to change its rights.
APPLIED = verbs("get list watch create patch delete")  # server-side apply, prune, watch
NAMESPACED_RULES: RuleTable = {
    ("fleetpilot.dev", "inferenceservices"): verbs("get list watch patch"),
    ("fleetpilot.dev", "inferenceservices/status"): verbs("get patch"),
    # blockOwnerDeletion on the children (OwnerReferencesPermissionEnforcement, OpenShift)
    ("fleetpilot.dev", "inferenceservices/finalizers"): verbs("update"),
    ("apps", "deployments"): APPLIED,
    ("", "services"): APPLIED,
    ("", "configmaps"): APPLIED,
    ("", "serviceaccounts"): APPLIED,
    ("rbac.authorization.k8s.io", "roles"): APPLIED,
    ("rbac.authorization.k8s.io", "rolebindings"): APPLIED,
    ("policy", "poddisruptionbudgets"): APPLIED,
    ("", "persistentvolumeclaims"): APPLIED,  # spec.modelCache's claim
    ("batch", "jobs"): APPLIED,  # the model cache's downloads and its GC
    ("networking.k8s.io", "networkpolicies"): APPLIED,
    ("monitoring.coreos.com", "podmonitors"): APPLIED,
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): APPLIED,  # multi-node roles
    ("inference.networking.k8s.io", "inferencepools"): APPLIED,  # routing.gateway
    ("gateway.networking.k8s.io", "httproutes"): APPLIED,  # routing.gateway.parentRefs
    ("apps", "deployments/scale"): verbs("get patch"),  # the in-operator autoscaler
    ("leaderworkerset.x-k8s.io", "leaderworkersets/scale"): verbs("get patch"),
    ("", "pods"): verbs("get list watch"),
    ("", "pods/log"): verbs("get"),  # a model download's progress (ModelReady)
    ("", "events"): verbs("create patch"),
    ("discovery.k8s.io", "endpointslices"): verbs("get list watch"),  # granted on to routers
}
# The leader election's Lease (the kubernetes client's LeaseLock reads, creates, replaces).
LEASE_RULES: RuleTable = {("coordination.k8s.io", "leases"): verbs("get create update")}
# kopf's cluster-scoped reads: CRDs in either scope, namespaces only when serving a list of them.
KOPF_CRD_RULES: RuleTable = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): verbs("list watch"),
}
KOPF_NAMESPACE_RULES: RuleTable = {("", "namespaces"): verbs("list watch")}
# The operator's node reads, in either scope: the largest allocatable memory by GPU product,
# which an engine pod's memory is checked against (operator.node_memory).
NODE_RULES: RuleTable = {("", "nodes"): verbs("get list watch")}
# kopf peering: cluster-wide operators use ClusterKopfPeering, namespaced ones KopfPeering.
CLUSTER_PEERING_RULES: RuleTable = {
    ("kopf.dev", "clusterkopfpeerings"): verbs("get list watch patch")
}
NAMESPACED_PEERING_RULES: RuleTable = {("kopf.dev", "kopfpeerings"): verbs("get list watch patch")}

NON_DEFAULT_VALUES: Obj = {
    "image": {"tag": "0.1.0-rc.1"},
    "routerImage": "registry.example.com/fleetpilot/router:0.1.0",
    "referenceImage": "registry.example.com/fleetpilot/reference:0.1.0",
    "prometheusURL": "http://prometheus-operated.monitoring:9090",
    "watchNamespaces": ["ml-prod", "ml-staging"],
    "peering": {"name": "fleet.prod"},
    "logFormat": "plain",
    "verbose": True,
    "healthPort": 8081,
    "serviceAccount": {"annotations": {"example.com/role": "operator"}},
    "podLabels": {"team": "ml-platform"},
    "nodeSelector": {"node-type": "cpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops"}],
    "priorityClassName": "system-cluster-critical",
    "imagePullSecrets": [{"name": "regcred"}],
    "metrics": {
        "port": 9191,
        "service": {"port": 8443, "annotations": {"prometheus.io/scrape": "true"}},
        "podMonitor": {
            "enabled": True,
            "interval": "15s",
            "scrapeTimeout": "10s",
            "labels": {"release": "kube-prometheus-stack"},
        },
    },
}


def rule_table(role: Obj) -> RuleTable:
    """RBAC rules as {(apiGroup, resource): verbs}; a pair granted twice is an error."""
    table: RuleTable = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, "no resourceNames/nonResourceURLs"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert (group, resource) not in table, f"{group}/{resource} granted twice"
                table[group, resource] = frozenset(rule["verbs"])
    return table


def operator_args(objects: list[Obj]) -> list[str]:
    container = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    args: list[str] = container["args"]
    return args


def group_and_plural(kind: str) -> tuple[str, str]:
    resource = RESOURCES[kind]
    group = resource.api_version.rpartition("/")[0]  # "" for the core group ("v1")
    return group, resource.plural


# -- metadata and lint -----------------------------------------------------------------------


def test_chart_versions_follow_the_package(chart: helm.Chart) -> None:
    """Chart version, appVersion, the default image tag and the router image the operator
    deploys by default all come from one release number."""
    assert chart.metadata["version"] == "0.1.0"
    assert chart.metadata["appVersion"] == "0.1.0" == __version__
    objects = render(chart)
    container = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == DEFAULT_FLEETPILOT_IMAGE
    assert f"--image={DEFAULT_FLEETPILOT_IMAGE}" in container["args"]


@pytest.mark.parametrize("values", [{}, NON_DEFAULT_VALUES], ids=["default", "non-default"])
def test_lint_is_clean(values: Obj) -> None:
    """`helm lint --strict` finds no warning or error, for default and non-default values."""
    report = helm.lint(CHART, values, strict=True, namespace=RELEASE_NAMESPACE)
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == []


# -- rendered objects ------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{}, NON_DEFAULT_VALUES], ids=["default", "non-default"])
def test_every_rendered_object_is_valid_kubernetes(chart: helm.Chart, values: Obj) -> None:
    """Strict schema validation (no unknown fields) of every built-in object the chart renders."""
    objects = render(chart, values)
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    for obj in objects:  # labels every object carries, for `kubectl get -l` and Helm
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "fleetpilot-0.1.0"


def test_default_values_render_a_cluster_wide_operator(chart: helm.Chart) -> None:
    """Defaults: one replica serving every namespace, with a ClusterKopfPeering to join."""
    objects = render(chart)
    assert sorted(obj["kind"] for obj in objects) == [
        "ClusterKopfPeering",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Pod",  # the `helm test` hook
        "Role",  # the leader election's Lease, in the release's namespace
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    deployment = only(objects, "Deployment")
    assert deployment["metadata"] == deployment["metadata"] | {
        "name": FULLNAME,
        "namespace": RELEASE_NAMESPACE,
    }
    assert deployment["spec"]["replicas"] == 1
    # A new pod stands by until the old one's Lease lapses: no need to stop the old first.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert operator_args(objects) == [
        "operator",
        "--all-namespaces",
        f"--peering={FULLNAME}",
        "--leader-election",
        f"--leader-election-namespace={RELEASE_NAMESPACE}",
        f"--leader-election-name={FULLNAME}",
        "--lease-duration=15",
        f"--image={DEFAULT_FLEETPILOT_IMAGE}",
        "--bind=0.0.0.0",
        "--liveness-port=8080",
        "--metrics-port=9090",
        "--log-format=json",
    ]
    assert only(objects, "ClusterKopfPeering")["metadata"]["name"] == FULLNAME
    # The engines' NetworkPolicy admits the operator's adapter loads by these labels.
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert OPERATOR_POD_LABELS.items() <= pod_labels.items()
    service = only(objects, "Service")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def _serve(text: str) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, format: str, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/metrics"


def test_helm_test_hook_checks_the_operators_metrics(chart: helm.Chart) -> None:
    """`helm test` runs a hook Pod (restricted like the operator) whose script passes against
    the operator's real metrics and fails against an endpoint without them."""
    hook = only(render(chart), "Pod")
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = hook["spec"]["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["METRICS_URL"] == f"http://{FULLNAME}-metrics.{RELEASE_NAMESPACE}.svc:9090/metrics"
    assert operator_metrics.RECONCILES is not None
    for text, passes in ((generate_latest().decode(), True), ("# nothing here\n", False)):
        server, url = _serve(text)
        try:
            done = subprocess.run(
                [sys.executable, *container["command"][1:]],
                env={**os.environ, "METRICS_URL": url},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        finally:
            server.shutdown()
            server.server_close()
        assert (done.returncode == 0) is passes, done.stderr


def test_operator_pod_is_locked_down(chart: helm.Chart) -> None:
    """Non-root, read-only root filesystem, no capabilities, RuntimeDefault seccomp, resource
    requests, and liveness/readiness on kopf's /healthz."""
    pod = only(render(chart), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"health": 8080, "metrics": 9090}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    # The only writable path on the read-only root filesystem.
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["serviceAccountName"] == FULLNAME


def test_non_default_values_reach_the_objects(chart: helm.Chart) -> None:
    """A namespaced watch list, a custom tag and peering name, a PodMonitor, and pod
    scheduling settings all end up where they belong."""
    objects = render(chart, NON_DEFAULT_VALUES)
    deployment = only(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "ghcr.io/fleetpilot/fleetpilot:0.1.0-rc.1"
    assert operator_args(objects) == [
        "operator",
        "--namespace=ml-prod",
        "--namespace=ml-staging",
        "--peering=fleet.prod",
        "--leader-election",
        f"--leader-election-namespace={RELEASE_NAMESPACE}",
        f"--leader-election-name={FULLNAME}",
        "--lease-duration=15",
        "--image=registry.example.com/fleetpilot/router:0.1.0",
        "--reference-image=registry.example.com/fleetpilot/reference:0.1.0",
        "--prometheus-url=http://prometheus-operated.monitoring:9090",
        "--bind=0.0.0.0",
        "--liveness-port=8081",
        "--metrics-port=9191",
        "--log-format=plain",
        "--verbose",
    ]
    assert {port["containerPort"] for port in container["ports"]} == {8081, 9191}
    assert pod["nodeSelector"] == {"node-type": "cpu"}
    assert pod["tolerations"] == NON_DEFAULT_VALUES["tolerations"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "ml-platform"
    # Namespaced: a KopfPeering, a Role and a RoleBinding in each watched namespace.
    for namespace in ("ml-prod", "ml-staging"):
        assert only(objects, "KopfPeering", namespace)["metadata"]["name"] == "fleet.prod"
        binding = only(objects, "RoleBinding", namespace)
        assert binding["roleRef"]["name"] == only(objects, "Role", namespace)["metadata"]["name"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NAMESPACE}
        ]
    assert not [obj for obj in objects if obj["kind"] == "ClusterKopfPeering"]
    service = only(objects, "Service")
    assert service["spec"]["ports"][0]["port"] == 8443
    assert service["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    monitor = only(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert (
        monitor["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NAMESPACE]}
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {
            "port": "metrics",
            "path": "/metrics",
            "honorLabels": True,  # the services' namespace, not the operator pod's
            "interval": "15s",
            "scrapeTimeout": "10s",
        }
    ]


def test_image_digest_wins_over_tag(chart: helm.Chart) -> None:
    """A digest pins the exact build; the router image follows the operator's."""
    digest = "sha256:" + "ab" * 32
    objects = render(chart, {"image": {"tag": "0.1.0", "digest": digest}})
    image = f"ghcr.io/fleetpilot/fleetpilot@{digest}"
    assert only(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"] == (
        image
    )
    assert f"--image={image}" in operator_args(objects)


def test_existing_service_account_is_bound_not_created(chart: helm.Chart) -> None:
    """serviceAccount.create=false binds the RBAC to the named account and creates none."""
    objects = render(chart, {"serviceAccount": {"create": False, "name": "ops-operator"}})
    assert not [obj for obj in objects if obj["kind"] == "ServiceAccount"]
    assert only(objects, "ClusterRoleBinding")["subjects"][0]["name"] == "ops-operator"
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ops-operator"


def test_long_release_names_give_valid_object_names(chart: helm.Chart) -> None:
    """Names are capped at 63 characters (label values and Service names allow no more)."""
    objects = render(chart, name="a-very-long-release-name-for-a-fleet-operator-in-production-x")
    for obj in objects:
        assert len(obj["metadata"]["name"]) <= 63
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("values", [{}, NON_DEFAULT_VALUES], ids=["default", "non-default"])
def test_operator_cli_accepts_the_chart_args(chart: helm.Chart, values: Obj) -> None:
    """The container args parse with fleetpilot's own CLI: no flag the operator lacks."""
    args = build_parser().parse_args(operator_args(render(chart, values)))
    assert args.command == "operator"
    assert args.all_namespaces == (not values.get("watchNamespaces"))
    assert args.namespace == values.get("watchNamespaces", [])
    assert args.standalone is False  # peering keeps an operator outside the election idle
    assert args.leader_election is True  # the Lease is what keeps two replicas from both acting


def test_several_replicas_stand_by_for_one_lease(chart: helm.Chart) -> None:
    """replicas > 1 with leader election: each pod knows its name and namespace (the Lease's
    holder and place), and may only get, create and update Leases in the release namespace."""
    objects = render(chart, {"replicas": 3, "leaderElection": {"leaseDuration": 30}})
    deployment = only(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    assert "--lease-duration=30" in operator_args(objects)
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    role = only(objects, "Role", RELEASE_NAMESPACE)
    assert rule_table(role) == LEASE_RULES
    binding = only(objects, "RoleBinding", RELEASE_NAMESPACE)
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_without_leader_election_one_replica_recreated(chart: helm.Chart) -> None:
    objects = render(chart, {"leaderElection": {"enabled": False}})
    assert only(objects, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert not any(a.startswith("--leader-election") for a in operator_args(objects))
    assert not [obj for obj in objects if obj["kind"] in {"Role", "RoleBinding"}]


# -- RBAC ------------------------------------------------------------------------------------


def test_cluster_wide_rbac_is_exactly_the_table(chart: helm.Chart) -> None:
    """watchNamespaces empty: one ClusterRole with the namespaced rules, kopf's CRD watch,
    ClusterKopfPeering and node reads; no Role, no KopfPeering and no namespace rights (kopf
    reads namespaces only when it serves a list of them)."""
    objects = render(chart)
    role = only(objects, "ClusterRole")
    assert (
        rule_table(role) == NAMESPACED_RULES | KOPF_CRD_RULES | CLUSTER_PEERING_RULES | NODE_RULES
    )
    binding = only(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NAMESPACE}
    ]
    # The only Role: the leader election's, in the release namespace.
    (role,) = [obj for obj in objects if obj["kind"] == "Role"]
    assert role["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert rule_table(role) == LEASE_RULES


def test_namespaced_rbac_is_exactly_the_table(chart: helm.Chart) -> None:
    """A watch list: the namespaced rules only in a Role per watched namespace; cluster-wide,
    only kopf's CRD and namespace reads and the operator's node reads."""
    objects = render(chart, {"watchNamespaces": ["ml-prod", "ml-staging"]})
    assert (
        rule_table(only(objects, "ClusterRole"))
        == KOPF_CRD_RULES | KOPF_NAMESPACE_RULES | NODE_RULES
    )
    for namespace in ("ml-prod", "ml-staging"):
        role = only(objects, "Role", namespace)
        assert rule_table(role) == NAMESPACED_RULES | NAMESPACED_PEERING_RULES


def test_rbac_grants_every_api_call_the_operator_makes() -> None:
    """The table against the code: every kind the reconciler applies and prunes, what kopf
    watches and patches, status writes, Events, and the Role each router is given (RBAC
    escalation prevention refuses a Role granting more than its creator holds)."""
    granted = NAMESPACED_RULES
    # The reconciler lists children to prune them, applies (PATCH; create when absent), deletes.
    for kind in (*MANAGED_KINDS, *OPTIONAL_KINDS):
        assert verbs("list create patch delete") <= granted[group_and_plural(kind)], kind
    # Every kind a plan can contain is one the reconciler manages (and so is granted above):
    # a multi-node role's LeaderWorkerSet included.
    service = make_service(
        tiers=[
            make_tier("small", up_to=0.4),
            make_tier("large", mode="disaggregated", up_to=0.7),
            make_tier(
                "huge", parallelism={"tensor": 4, "pipeline": 2}, resources={"gpusPerNode": 4}
            ),
        ]
    )
    planned = plan(service, PlanOptions(pod_monitor_available=True))
    assert "LeaderWorkerSet" in {obj["kind"] for obj in planned}
    assert {obj["kind"] for obj in planned} <= {*MANAGED_KINDS, *OPTIONAL_KINDS}
    # kopf: watch + patch InferenceServices; watch child workloads and pods (status refresh).
    assert verbs("list watch patch get") <= granted[group_and_plural("InferenceService")]
    for kind in ("Deployment", "LeaderWorkerSet", "Pod"):
        assert verbs("list watch") <= granted[group_and_plural(kind)], kind
    # The autoscaler reads and scales each engine workload through its scale subresource.
    for role in all_roles(service):
        kind, _ = names.engine_workload(service.name, role)
        group, plural = group_and_plural(kind)
        assert verbs("get patch") <= granted[group, f"{plural}/scale"], kind
    assert "patch" in granted["fleetpilot.dev", "inferenceservices/status"]
    assert "create" in granted[group_and_plural("Event")]
    # Each router Role's rules must be held by the operator itself.
    for role in (obj for obj in planned if obj["kind"] == "Role"):
        for (group, resource), wanted in rule_table(role).items():
            assert wanted <= granted.get((group, resource), frozenset()), (group, resource)


# -- values: validation and schema -----------------------------------------------------------


@pytest.fixture(scope="module")
def chart_without_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[helm.Chart]:
    """The chart as `helm install --skip-schema-validation` sees it: only _validations.tpl."""
    copy = tmp_path_factory.mktemp("chart") / "fleetpilot"
    shutil.copytree(CHART, copy)
    (copy / "values.schema.json").unlink()
    with helm.Chart.load(copy) as loaded:
        yield loaded


# (values, the _validations.tpl message). The schema refuses most of these too; the template
# checks must hold on their own.
INVALID_VALUES = [
    pytest.param({"replicas": 0}, "replicas must be at least 1 (got 0)", id="no-replicas"),
    pytest.param({"image": {"tag": "latest"}}, 'image.tag "latest" is not allowed', id="latest"),
    pytest.param({"image": {"digest": "sha256:abc"}}, "image.digest must look like", id="digest"),
    pytest.param({"logFormat": "xml"}, "logFormat must be json or plain (got xml)", id="log"),
    pytest.param(
        {"watchNamespaces": ["ML"]}, 'watchNamespaces entry "ML" is not a valid', id="ns-name"
    ),
    pytest.param(
        {"watchNamespaces": ["ml", "ml"]}, "watchNamespaces lists a namespace twice", id="ns-dup"
    ),
    pytest.param(
        {"peering": {"name": "Fleet_Pilot"}}, 'peering.name "Fleet_Pilot" is not a valid', id="peer"
    ),
]

# Rules no schema can state (cross-field, derived names): refused by the real chart too.
INVALID_BEYOND_SCHEMA = [
    pytest.param(
        {"replicas": 2, "leaderElection": {"enabled": False}},
        "replicas must be 1 without leaderElection.enabled (got 2)",
        id="two-replicas",
    ),
    pytest.param(
        {"healthPort": 9090}, "healthPort and metrics.port must differ (both 9090)", id="ports"
    ),
    pytest.param(
        {"serviceAccount": {"create": False}},
        "serviceAccount.name is required when serviceAccount.create is false",
        id="no-account",
    ),
    pytest.param(
        {"fullnameOverride": "Fleet_Pilot"}, 'peering.name "Fleet_Pilot" is not a valid', id="name"
    ),
]


@pytest.mark.parametrize(("values", "message"), INVALID_VALUES + INVALID_BEYOND_SCHEMA)
def test_template_validations_refuse_bad_values(
    chart_without_schema: helm.Chart, values: Obj, message: str
) -> None:
    """_validations.tpl fails the render with a message naming the value and the fix."""
    with pytest.raises(helm.HelmRenderError) as refused:
        render(chart_without_schema, values)
    assert f"fleetpilot: {message}" in str(refused.value)


@pytest.mark.parametrize(("values", "message"), INVALID_BEYOND_SCHEMA)
def test_chart_refuses_values_the_schema_cannot_judge(
    chart: helm.Chart, values: Obj, message: str
) -> None:
    """With the schema in place, cross-field rules still stop the install."""
    with pytest.raises(helm.HelmRenderError) as refused:
        render(chart, values)
    assert f"fleetpilot: {message}" in str(refused.value)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        pytest.param({"replicas": "two"}, "/replicas", id="replicas-string"),
        pytest.param({"replicas": 6}, "/replicas", id="replicas-six"),
        pytest.param({"leaderElection": {"leaseDuration": 2}}, "/leaseDuration", id="lease"),
        pytest.param({"watchNamespaces": "ml"}, "/watchNamespaces", id="namespaces-string"),
        pytest.param({"logFormat": "xml"}, "/logFormat", id="log-enum"),
        pytest.param({"image": {"tag": "latest"}}, "/image/tag", id="latest"),
        pytest.param({"image": {"tag": 1}}, "/image/tag", id="tag-number"),
        pytest.param({"metrics": {"port": 70000}}, "/metrics/port", id="port-range"),
        pytest.param({"metrics": {"podMonitor": {"enabled": "yes"}}}, "/enabled", id="bool"),
        pytest.param({"metrics": {"podMonitor": {"interval": "30"}}}, "/interval", id="duration"),
        pytest.param({"replica": 1}, "additional properties 'replica'", id="typo"),
    ],
)
def test_schema_refuses_wrong_values(chart: helm.Chart, values: Obj, where: str) -> None:
    """values.schema.json refuses wrong types, enums and typos before anything renders."""
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(chart.merge_values(values))
    assert where in str(refused.value)
    with pytest.raises(helm.HelmValuesError):
        render(chart, values)


def test_schema_and_values_yaml_cover_the_same_keys(chart: helm.Chart) -> None:
    """Every default is typed by the schema and every schema key has a documented default,
    with a comment directly above it in values.yaml."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    chart.validate_schema(chart.values)
    documented = _commented_keys((CHART / "values.yaml").read_text())

    def walk(node: Obj, defaults: Obj, prefix: str) -> None:
        # Kubernetes types (resources, securityContext, affinity, ...) are documented as a
        # whole, above their key; the chart's own settings key by key.
        assert set(node["properties"]) - {"global"} == set(defaults), prefix or "top level"
        for key, sub in node["properties"].items():
            if key == "global":
                continue
            path = f"{prefix}{key}"
            if (
                "properties" in sub
                and sub.get("additionalProperties") is False
                and key not in {"resources"}
            ):
                walk(sub, defaults[key], f"{path}.")
            else:
                assert path in documented, f"values.yaml: {path} has no comment above it"

    walk(schema, chart.values, "")


def _commented_keys(text: str) -> set[str]:
    """Dotted paths of the keys in values.yaml with a comment line directly above them."""
    stack: list[tuple[int, str]] = []
    found: set[str] = set()
    previous = ""
    for line in text.splitlines():
        match = re.match(r"^( *)([A-Za-z][A-Za-z0-9]*):", line)
        if match:
            indent = len(match.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match.group(2)))
            if previous.lstrip().startswith("#"):
                found.add(".".join(key for _, key in stack))
        if line.strip():
            previous = line
    return found


# -- CRDs and image --------------------------------------------------------------------------


def test_chart_crd_is_the_generated_one() -> None:
    """charts/fleetpilot/crds/ carries the generated CRD byte for byte (header included), so
    `helm install` and `kubectl apply -f crds/` install the same API. Fix: copy
    crds/inferenceservices.fleetpilot.dev.yaml into charts/fleetpilot/crds/."""
    name = "inferenceservices.fleetpilot.dev.yaml"
    assert (CHART / "crds" / name).read_bytes() == (REPO / "crds" / name).read_bytes()


def test_chart_crds_are_valid_and_match_kopf(chart: helm.Chart) -> None:
    """The three CRDs the chart installs are valid, and the peering ones are where the installed
    kopf looks for them (group, version, plural, scope)."""
    # kopf keeps these selectors private; reading them pins the CRDs to the kopf in use.
    from kopf._cogs.structs import references

    crds = {yaml.safe_load(item["data"])["metadata"]["name"]: item for item in chart.crds}
    assert set(crds) == {
        "inferenceservices.fleetpilot.dev",
        "kopfpeerings.kopf.dev",
        "clusterkopfpeerings.kopf.dev",
    }
    for item in crds.values():
        kubernetes_validate.validate(yaml.safe_load(item["data"]), K8S_VERSION, strict=True)
    for selector, scope in [
        (references.NAMESPACED_PEERINGS_K, "Namespaced"),
        (references.CLUSTER_PEERINGS_K, "Cluster"),
    ]:
        crd = yaml.safe_load(crds[f"{selector.any_name}.{selector.group}"]["data"])
        assert crd["spec"]["scope"] == scope
        assert [v["name"] for v in crd["spec"]["versions"]] == [selector.version]
        status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
        # kopf writes one key per operator identity under .status.
        assert status["x-kubernetes-preserve-unknown-fields"] is True


def test_image_runs_as_the_chart_expects(chart: helm.Chart) -> None:
    """The Dockerfile's user is the chart's runAsUser, its base is pinned, its default command
    is a valid operator command line, and it installs no extras (no torch)."""
    text = DOCKERFILE.read_text()
    assert re.search(r"^ENTRYPOINT \[\"fleetpilot\"\]$", text, re.M)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert cmd is not None
    args = build_parser().parse_args(json.loads(cmd.group(1)))
    assert args.command == "operator"
    assert args.all_namespaces
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    assert user is not None
    pod_security = chart.values["podSecurityContext"]
    assert (int(user.group(1)), int(user.group(2))) == (
        pod_security["runAsUser"],
        pod_security["runAsGroup"],
    )
    base = re.search(r"^ARG PYTHON_IMAGE=python:(\S+)$", text, re.M)
    assert base is not None
    assert re.fullmatch(r"3\.11\.\d+-slim(-\w+)?", base.group(1)), "pin a full 3.11.x tag"
    assert "[engine" not in text
