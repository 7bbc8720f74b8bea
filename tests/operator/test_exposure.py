"""What the planned pods expose (issue 41, probe 5): engine pods hold no Kubernetes API token
and run as an account of their own; the router's /metrics (tenant names, replica addresses)
is on a port of its own that its client Service does not expose, and every consumer of that
port - the router's config, its pod, the PodMonitor, the NetworkPolicy - names the same one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fleetpilot.api import load_services
from fleetpilot.api.router_config import ROUTER_CONFIG_FILE, RouterConfig
from fleetpilot.kube import names
from fleetpilot.operator.plan_types import K8sObject, PlanOptions
from fleetpilot.operator.planner import plan
from fleetpilot.operator.router_objects import ROUTER_METRICS_PORT, ROUTER_PORT
from tests.factories import make_service, make_tier
from tests.operator.delivery_support import CACHE, S3, tier_with

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ENGINE_ACCOUNT = "chat-engines"


def _all(objects: list[K8sObject], kind: str) -> list[K8sObject]:
    return [o for o in objects if o["kind"] == kind]


def _one(objects: list[K8sObject], kind: str, name: str) -> K8sObject:
    (found,) = [o for o in _all(objects, kind) if o["metadata"]["name"] == name]
    return found


def _pd_plan(**spec: Any) -> list[K8sObject]:
    tiers = [make_tier("small", up_to=0.4), make_tier("large", mode="disaggregated")]
    options = PlanOptions(pod_monitor_available=True)
    return plan(make_service(tiers=tiers, uid="1234", **spec), options)


def _engine_pod_specs(objects: list[K8sObject]) -> list[dict[str, Any]]:
    """Every engine pod template's spec: Deployments', and LeaderWorkerSets' leader and worker."""
    specs = []
    for deployment in _all(objects, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        if labels.get(names.LABEL_COMPONENT) == "engine":
            specs.append(deployment["spec"]["template"]["spec"])
    for lws in _all(objects, "LeaderWorkerSet"):
        template = lws["spec"]["leaderWorkerTemplate"]
        specs += [template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]]
    return specs


# -- engine pods: their own account, no token ------------------------------------------------


def test_engine_pods_run_as_their_own_account_without_a_token() -> None:
    """Regression (issue 41): engine pods mounted the namespace default account's API token.
    Each engine pod template (unified, prefill, decode) now names the service's engine account
    and mounts no token; the account is planned, owned by the service, mounts no token by
    default either, and no Role or RoleBinding names it."""
    objects = _pd_plan()
    specs = _engine_pod_specs(objects)
    assert len(specs) == 3
    for spec in specs:
        assert spec["serviceAccountName"] == ENGINE_ACCOUNT
        assert spec["automountServiceAccountToken"] is False
    account = _one(objects, "ServiceAccount", ENGINE_ACCOUNT)
    assert account["automountServiceAccountToken"] is False
    assert account["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    assert account["metadata"]["labels"][names.LABEL_SERVICE] == "chat"
    bound = [
        subject["name"]
        for binding in _all(objects, "RoleBinding")
        for subject in binding["subjects"]
    ]
    assert ENGINE_ACCOUNT not in bound
    # Before the workloads whose pods name it: a pod naming a missing account is refused.
    kinds = [o["kind"] + "/" + o["metadata"]["name"] for o in objects]
    first_engine = min(
        i
        for i, o in enumerate(objects)
        if o["kind"] == "Deployment" and o["metadata"]["name"] != "chat-router"
    )
    assert kinds.index(f"ServiceAccount/{ENGINE_ACCOUNT}") < first_engine


def test_multi_node_leaders_and_workers_mount_no_token() -> None:
    """The LeaderWorkerSet's leader and worker templates hold no token either."""
    (service,) = load_services(EXAMPLES / "llama-405b-multinode.yaml")
    objects = plan(service)
    account = names.engine_service_account_name(service.name)
    specs = _engine_pod_specs(objects)
    assert _all(objects, "LeaderWorkerSet")
    for spec in specs:
        assert spec["serviceAccountName"] == account
        assert spec["automountServiceAccountToken"] is False


def test_an_overlay_account_replaces_the_engine_account_but_not_the_token_rule() -> None:
    """A tier's podTemplate may name its own account (workload identity for a bucket); the
    API token stays unmounted."""
    tier = make_tier("small") | {"podTemplate": {"serviceAccountName": "bucket-reader"}}
    (spec,) = _engine_pod_specs(plan(make_service(tiers=[tier])))
    assert spec["serviceAccountName"] == "bucket-reader"
    assert spec["automountServiceAccountToken"] is False


def test_the_router_keeps_its_token_for_endpoint_slice_discovery() -> None:
    """The router watches its engines' EndpointSlices through the API: its pods keep their
    own account's token (bound to a read-only Role)."""
    objects = _pd_plan()
    router = _one(objects, "Deployment", "chat-router")["spec"]["template"]["spec"]
    assert router["serviceAccountName"] == "chat-router"
    assert router.get("automountServiceAccountToken", True) is True
    binding = _one(objects, "RoleBinding", "chat-router")
    assert binding["subjects"][0]["name"] == "chat-router"


def test_model_cache_jobs_mount_no_token() -> None:
    """The download and GC Jobs never call the API either."""
    objects = plan(make_service(tiers=[tier_with({"s3": S3})], modelCache=CACHE))
    jobs = _all(objects, "Job")
    assert jobs
    for job in jobs:
        assert job["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# -- the router's metrics port ----------------------------------------------------------------


def test_router_metrics_are_on_their_own_port_everywhere_it_is_named() -> None:
    """Regression (issue 41): the router's /metrics was on the port its Service exposes to
    every client. The config sets metricsPort; the pod declares it as "metrics"; the Service
    exposes only the API port; the scrape annotation and the PodMonitor name the metrics port,
    and the PodMonitor's engine endpoint leaves the routers' API port alone."""
    objects = _pd_plan()
    config_map = _one(objects, "ConfigMap", "chat-router")
    config = RouterConfig.model_validate(yaml.safe_load(config_map["data"][ROUTER_CONFIG_FILE]))
    assert (config.port, config.metrics_port) == (ROUTER_PORT, ROUTER_METRICS_PORT)
    template = _one(objects, "Deployment", "chat-router")["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": ROUTER_PORT, "metrics": ROUTER_METRICS_PORT}
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(ROUTER_METRICS_PORT)
    # Probes stay on the API port, which still serves /health.
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    service = _one(objects, "Service", "chat-router")
    assert [p["port"] for p in service["spec"]["ports"]] == [ROUTER_PORT]

    monitor = _one(objects, "PodMonitor", "chat-metrics")
    engines, routers = monitor["spec"]["podMetricsEndpoints"]
    assert routers["port"] == "metrics"
    assert engines["port"] == "http"
    (keep,) = engines["relabelings"]
    assert keep == {
        "action": "keep",
        "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
        "regex": "engine",
    }
    engine_labels = [
        d["spec"]["template"]["metadata"]["labels"]
        for d in _all(objects, "Deployment")
        if d["metadata"]["name"] != "chat-router"
    ]
    assert all(labels[names.LABEL_COMPONENT] == "engine" for labels in engine_labels)
    assert template["metadata"]["labels"][names.LABEL_COMPONENT] != "engine"
