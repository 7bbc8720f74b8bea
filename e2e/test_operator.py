"""The real kopf operator against the real control plane.

Each test applies InferenceServices the way a user or GitOps tool would and checks what the
operator does to the cluster: objects created, pruned and garbage-collected; replicas owned
by the autoscaler surviving a re-applied spec; status that turns Ready only when the pods
(reported Ready by the test, in the kubelet's place) are; refusals reported, never half-applied.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.chart_support import CRD_PATH, apply, can, install_identity, release_name, render
from e2e.support import condition, finish_job_pods, mark_pods_ready
from fleetpilot.api import parse_service
from fleetpilot.api.layout import role_layout
from fleetpilot.api.router_config import ROUTER_CONFIG_FILE, RouterConfig
from fleetpilot.engine.adapter_client import AdapterClient
from fleetpilot.engine.reference.lora import random_adapter, save_adapter
from fleetpilot.engine.reference.settings import MODEL_PRESETS
from fleetpilot.engine.vllm_args import ENGINE_PORT
from fleetpilot.kube import names
from fleetpilot.kube.client import MERGE_CONTENT_TYPE, RESOURCES, Kube, KubeError, Obj
from fleetpilot.kube.managers import AUTOSCALER_MANAGER
from fleetpilot.operator.engine_objects import engine_command
from fleetpilot.operator.plan_types import PlanOptions
from fleetpilot.operator.planner import all_roles, plan
from fleetpilot.operator.reconcile import Reconciler
from fleetpilot.runtime.processes import free_ports, http_ok
from fleetpilot.runtime.prometheus import PrometheusServer
from fleetpilot.testing.cluster import Cluster
from fleetpilot.testing.engine_server import BackgroundServer
from fleetpilot.testing.polling import eventually
from tests.autoscaler.support import Engine, EngineKey, Load
from tests.factories import make_manifest, make_tier
from tests.support.argocd import argocd_health
from tests.support.kstatus import kstatus
from tests.support.kube import CountingKube

pytestmark = pytest.mark.cluster

H100 = "NVIDIA-H100-80GB-HBM3"
MANAGER = "e2e-test"


@pytest.fixture(scope="module")
def gpu_node(control_plane: Cluster) -> None:
    if not control_plane.fake_nodes:
        pytest.skip("needs fake GPU nodes, only added to a cluster the tests started")
    control_plane.add_gpu_node("op-h100-0", H100, gpus=8)


@dataclass(frozen=True)
class OperatorIdentity:
    """The chart's ServiceAccount and RBAC, installed for the test's namespace."""

    kubeconfig: Path
    peering: str


@pytest.fixture
def identity(
    control_plane: Cluster,
    kube: Kube,
    chart: helm.Chart,
    chart_crds: None,
    namespace: str,
    tmp_path: Path,
) -> Iterator[OperatorIdentity]:
    """Credentials of the chart's ServiceAccount: the operator runs with exactly the rights
    the chart grants (watching the test's namespace), so a call it lacks fails the test."""
    objects = render(chart, {"watchNamespaces": [namespace]}, release_name(), namespace)
    cluster_scoped = install_identity(kube, objects)
    try:
        account = next(o for o in objects if o["kind"] == "ServiceAccount")["metadata"]["name"]
        peering = next(o for o in objects if o["kind"] == "KopfPeering")["metadata"]["name"]
        kubeconfig = control_plane.service_account_kubeconfig(
            namespace, account, tmp_path / "operator.kubeconfig"
        )
        with Cluster(kubeconfig).api_client() as api:
            as_operator = Kube(api)
            # The authorizer reads RBAC through an informer: wait for the new bindings.
            eventually(
                "RBAC for the operator",
                lambda: (
                    can(as_operator, "watch", "fleetpilot.dev", "inferenceservices", namespace)
                    or None
                ),
            )
        yield OperatorIdentity(kubeconfig, peering)
    finally:
        for path in cluster_scoped:
            kube.request("DELETE", path)


OperatorFactory = Callable[..., "subprocess.Popen[bytes]"]


@pytest.fixture
def start_operator(
    identity: OperatorIdentity, namespace: str, tmp_path: Path
) -> Iterator[OperatorFactory]:
    """Starts `fleetpilot operator` processes (with peering, under the chart's RBAC); stops
    every one it started at the end of the test."""
    started: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def start(*extra_args: str) -> subprocess.Popen[bytes]:
        (port,) = free_ports(1)
        log_path = tmp_path / f"operator-{len(started)}.log"
        logs.append(log_path)
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    sys.executable, "-m", "fleetpilot", "operator",
                    "--kubeconfig", str(identity.kubeconfig),
                    "--namespace", namespace, "--peering", identity.peering,
                    "--bind", "127.0.0.1", "--liveness-port", str(port), "--metrics-port", "0",
                    "--log-format", "plain", *extra_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        started.append(process)

        def healthy() -> bool | None:
            if process.poll() is not None:
                raise AssertionError(f"operator exited:\n{log_path.read_text()[-3000:]}")
            return http_ok(f"http://127.0.0.1:{port}/healthz") or None

        eventually("operator liveness", healthy, timeout=30)
        return process

    try:
        yield start
    finally:
        for process in started:
            stop(process)
        for path in logs:
            print(path.read_text()[-5000:])
            # A call the chart's RBAC refuses shows up as a 403 in the operator's log.
            assert " 403 " not in path.read_text(), f"forbidden API call in {path.name}"


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture
def operator(start_operator: OperatorFactory) -> subprocess.Popen[bytes]:
    return start_operator()


def small_service(namespace: str, **spec: Any) -> Obj:
    tier = make_tier(
        "small",
        resources={"gpuProduct": H100, "cpu": "1", "memory": "1Gi"},
        serving={"replicas": {"min": 1, "max": 4}},
    )
    manifest = make_manifest("chat", namespace=namespace, tiers=[tier], routing={"replicas": 1})
    manifest["spec"].update(spec)
    return manifest


def apply_service(kube: Kube, manifest: Obj) -> Obj:
    return kube.apply(manifest, MANAGER)


def get(kube: Kube, kind: str, namespace: str, name: str) -> Obj | None:
    return kube.get(kind, namespace, name)


def test_service_becomes_ready_only_when_pods_are(
    kube: Kube, namespace: str, operator: Any, gpu_node: None
) -> None:
    """Create -> children applied, status Ready=False until the kubelet's part reports Ready."""
    service = apply_service(kube, small_service(namespace))
    eventually("engine Deployment", lambda: get(kube, "Deployment", namespace, "chat-small"))
    eventually("router Deployment", lambda: get(kube, "Deployment", namespace, "chat-router"))

    def status() -> Obj | None:
        current = get(kube, "InferenceService", namespace, "chat")
        return current if current and current.get("status", {}).get("conditions") else None

    current = eventually("status", status)
    ready = condition(current, "Ready")
    assert ready is not None
    assert ready["status"] == "False"
    assert current["status"]["observedGeneration"] == service["metadata"]["generation"]
    assert current["status"]["endpoint"] == f"http://chat-router.{namespace}.svc:8000/v1"

    selector = {"fleetpilot.dev/service": "chat"}
    eventually("pods scheduled", lambda: mark_pods_ready(kube, namespace, selector) >= 2 or None)

    def is_ready() -> Obj | None:
        mark_pods_ready(kube, namespace, selector)
        current = get(kube, "InferenceService", namespace, "chat")
        state = condition(current, "Ready")
        return current if state and state["status"] == "True" else None

    current = eventually("Ready=True", is_ready, timeout=90)
    assert current["status"]["tiersReady"] == "1/1"
    (tier,) = current["status"]["tiers"]
    ((role, cold_start),) = [(r, r.pop("coldStart", None)) for r in tier["roles"]]
    assert role == {"role": "unified", "replicas": 1, "ready": 1}
    # The harness reports the engine started and Ready in the same second (the test below
    # measures a known start).
    assert cold_start is not None
    assert cold_start["start"]["maxSeconds"] == 0
    for item in current["status"]["conditions"]:
        assert item["observedGeneration"] == current["metadata"]["generation"]


def reapply_changed(kube: Kube, manifest: Obj) -> Obj:
    """Re-apply ``manifest`` with an engine env var added, as a GitOps sync of a changed spec
    would; the engine Deployment once the operator has applied the change."""
    namespace = manifest["metadata"]["namespace"]
    changed = copy.deepcopy(manifest)
    changed["spec"]["tiers"][0]["engine"] = {"env": [{"name": "EXTRA", "value": "1"}]}
    apply_service(kube, changed)

    def rolled() -> Obj | None:
        deployment = get(kube, "Deployment", namespace, "chat-small")
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"] if deployment else []
        return deployment if any(e["name"] == "EXTRA" for e in env) else None

    return eventually("spec change applied", rolled)


def test_autoscaled_replicas_survive_a_reapplied_spec(
    kube: Kube, namespace: str, operator: Any, gpu_node: None
) -> None:
    """The autoscaler's field manager owns replicas; a spec change must not reset them."""
    manifest = small_service(namespace)
    apply_service(kube, manifest)
    eventually("engine Deployment", lambda: get(kube, "Deployment", namespace, "chat-small"))
    kube.request(
        "PATCH",
        f"/apis/apps/v1/namespaces/{namespace}/deployments/chat-small/scale",
        query=[("fieldManager", AUTOSCALER_MANAGER)],
        body={"spec": {"replicas": 3}},
        content_type="application/merge-patch+json",
    )
    deployment = reapply_changed(kube, manifest)
    assert deployment["spec"]["replicas"] == 3


def test_a_real_hpa_owns_the_replicas_of_an_external_tier(
    kube: Kube, namespace: str, operator: Any, gpu_node: None
) -> None:
    """autoscaling.mode external: the controller-manager's own HPA controller scales the
    role's Deployment (to its minReplicas: no metrics are needed for that), and a re-applied,
    changed spec leaves the HPA's replicas alone."""
    manifest = small_service(namespace)
    manifest["spec"]["tiers"][0]["autoscaling"] = {"mode": "external"}
    apply_service(kube, manifest)
    eventually("engine Deployment", lambda: get(kube, "Deployment", namespace, "chat-small"))
    kube.request(
        "POST",
        f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers",
        body={
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "chat-small"},
            "spec": {
                "scaleTargetRef": {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": "chat-small",
                },
                "minReplicas": 3,
                "maxReplicas": 5,
                "metrics": [
                    {
                        "type": "Resource",
                        "resource": {
                            "name": "cpu",
                            "target": {"type": "Utilization", "averageUtilization": 80},
                        },
                    }
                ],
            },
        },
    )

    def replicas() -> int:
        deployment = get(kube, "Deployment", namespace, "chat-small")
        assert deployment is not None
        return int(deployment["spec"]["replicas"])

    eventually("the HPA's scale to its minimum", lambda: replicas() == 3 or None, timeout=90)
    deployment = reapply_changed(kube, manifest)
    assert deployment["spec"]["replicas"] == 3


def test_removed_tier_is_pruned_and_added_tier_created(
    kube: Kube, namespace: str, operator: Any, gpu_node: None
) -> None:
    """A tier removed from the spec loses its Deployment (pruned by the operator), and a tier
    added gets one."""
    manifest = small_service(namespace)
    manifest["spec"]["tiers"][0]["complexity"] = {"upTo": 0.5}
    manifest["spec"]["tiers"].append(
        make_tier("large", resources={"gpuProduct": H100, "cpu": "1", "memory": "1Gi"}, tensor=2)
    )
    apply_service(kube, manifest)
    eventually("large tier", lambda: get(kube, "Deployment", namespace, "chat-large"))
    manifest["spec"]["tiers"].pop()
    del manifest["spec"]["tiers"][0]["complexity"]
    apply_service(kube, manifest)
    # The prune deletes one object after another (the Deployment before its PodDisruptionBudget),
    # so all three are waited for: the Deployment gone says nothing yet of the PDB.
    pruned = ("Service", "Deployment", "PodDisruptionBudget")
    eventually(
        "large tier pruned",
        lambda: (
            True if all(get(kube, k, namespace, "chat-large") is None for k in pruned) else None
        ),
    )
    assert get(kube, "Deployment", namespace, "chat-small") is not None


def test_refused_plan_sets_degraded_and_applies_nothing(
    kube: Kube, namespace: str, operator: Any
) -> None:
    """A spec the CRD accepts but the planner refuses: Degraded with the field, no objects."""
    manifest = small_service(namespace)
    manifest["spec"]["tiers"][0]["engine"] = {"extraArgs": ["--port=9000"]}
    apply_service(kube, manifest)

    def degraded() -> Obj | None:
        state = condition(get(kube, "InferenceService", namespace, "chat"), "Degraded")
        return state if state and state["status"] == "True" else None

    state = eventually("Degraded", degraded)
    # A refused service never stops the operator serving the others.
    other = small_service(namespace)
    other["metadata"]["name"] = "other"
    apply_service(kube, other)
    eventually("other service served", lambda: get(kube, "Deployment", namespace, "other-small"))
    assert state["reason"] == "PlanRefused"
    assert "spec.tiers[0].engine.extraArgs[0]" in state["message"]
    assert kube.list("Deployment", namespace, {"fleetpilot.dev/service": "chat"}) == []
    events = kube.list("Event", namespace, {})
    assert any(e.get("reason") == "PlanRefused" for e in events)


def test_flux_and_argocd_read_each_phase_of_a_live_service_right(
    kube: Kube, namespace: str, operator: Any, gpu_node: None
) -> None:
    """The objects the operator wrote, read by the real judges: Flux's kstatus (cli-utils,
    pinned) and Argo CD's health.lua (real Lua 5.1). Rolling out is InProgress/Progressing,
    ready is Current/Healthy, a refused plan and pods the API refuses to create (a quota) are
    Failed/Degraded - where before Flux called a service Current after its first reconcile."""

    def judged(name: str) -> tuple[str, str] | None:
        current = get(kube, "InferenceService", namespace, name)
        status = (current or {}).get("status", {})
        if current is None or status.get("observedGeneration") != current["metadata"]["generation"]:
            return None
        return kstatus([current])[0]["status"], argocd_health(current)["status"]

    def phase(name: str, wanted: tuple[str, str], *, mark: bool = False) -> tuple[str, str]:
        def probe() -> tuple[str, str] | None:
            if mark:
                mark_pods_ready(kube, namespace, {"fleetpilot.dev/service": name})
            return judged(name) if judged(name) == wanted else None

        return eventually(f"{name}: {wanted}", probe, timeout=90)

    apply_service(kube, small_service(namespace))
    # Written before any pod is ready: the rollout is under way.
    eventually("first status", lambda: judged("chat"))
    assert judged("chat") == ("InProgress", "Progressing")
    phase("chat", ("Current", "Healthy"), mark=True)

    refused = small_service(namespace)
    refused["spec"]["tiers"][0]["engine"] = {"extraArgs": ["--port=9000"]}
    apply_service(kube, refused)
    phase("chat", ("Failed", "Degraded"))
    stalled = condition(get(kube, "InferenceService", namespace, "chat"), "Stalled")
    assert stalled is not None
    assert stalled["reason"] == "PlanRefused"

    # No pod may be created in the namespace any more: the ReplicaSets fail to create them.
    kube.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/resourcequotas",
        body={
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "no-pods"},
            "spec": {"hard": {"pods": "0"}},
        },
    )
    other = small_service(namespace)
    other["metadata"]["name"] = "quota"
    apply_service(kube, other)
    phase("quota", ("Failed", "Degraded"))
    stalled = condition(get(kube, "InferenceService", namespace, "quota"), "Stalled")
    assert stalled is not None
    assert stalled["reason"] == "ReplicaFailure"
    assert "quota" in stalled["message"]


def test_deleting_the_service_garbage_collects_everything(
    kube: Kube, namespace: str, operator: Any, gpu_node: None
) -> None:
    """Every child carries an ownerReference to the service, so deleting the service leaves
    nothing behind (the API server's garbage collector, not the operator, removes them)."""
    apply_service(kube, small_service(namespace))
    eventually("router", lambda: get(kube, "Deployment", namespace, "chat-router"))
    kube.delete("InferenceService", namespace, "chat")
    selector = {"fleetpilot.dev/service": "chat"}

    def gone() -> bool | None:
        left = [kind for kind in ("Deployment", "Service", "ConfigMap", "ServiceAccount")
                if kube.list(kind, namespace, selector)]  # fmt: skip
        return True if not left else None

    eventually("children garbage-collected", gone, timeout=90)


def test_a_service_deletes_while_no_operator_runs(
    kube: Kube, namespace: str, start_operator: OperatorFactory, gpu_node: None
) -> None:
    """No finalizer on a service (the autoscaler is a loop, not a kopf timer): uninstall the
    operator first and `kubectl delete` still completes; one left by an older release (kopf's
    marker) is taken off by the operator, so that one deletes too."""
    old_marker = "kopf.zalando.org/KopfFinalizerMarker"
    operator = start_operator()
    apply_service(kube, small_service(namespace))
    legacy = small_service(namespace)
    legacy["metadata"]["name"] = "legacy"
    legacy["metadata"]["finalizers"] = [old_marker]
    apply_service(kube, legacy)
    eventually("router", lambda: get(kube, "Deployment", namespace, "chat-router"))

    def finalizers(name: str) -> list[str] | None:
        current = get(kube, "InferenceService", namespace, name)
        assert current is not None
        return current["metadata"].get("finalizers") or []

    eventually("legacy finalizer removed", lambda: finalizers("legacy") == [] or None, timeout=60)
    # The operator has worked on it (children and status) and put no finalizer on it.
    eventually(
        "status", lambda: condition(get(kube, "InferenceService", namespace, "chat"), "Ready")
    )
    assert finalizers("chat") == []

    stop(operator)
    for name in ("chat", "legacy"):
        kube.delete("InferenceService", namespace, name)

    def deleted() -> bool | None:
        left = [n for n in ("chat", "legacy") if get(kube, "InferenceService", namespace, n)]
        return True if not left else None

    eventually("both deleted with no operator running", deleted, timeout=30)


def test_pods_are_admitted_where_the_restricted_pod_security_standard_is_enforced(
    kube: Kube, namespace: str, operator: Any, gpu_node: None
) -> None:
    """The API server's own PodSecurity admission, enforcing `restricted` on the namespace,
    admits every engine and router pod the operator plans (and refuses a plain pod, so the
    enforcement is real); the pods spread over zones and nodes."""
    kube.request(
        "PATCH",
        f"/api/v1/namespaces/{namespace}",
        body={
            "metadata": {
                "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/enforce-version": "latest",
                }
            }
        },
        content_type=MERGE_CONTENT_TYPE,
    )
    plain = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    with pytest.raises(KubeError, match="restricted"):
        kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=plain)

    apply_service(kube, small_service(namespace))
    selector = {"fleetpilot.dev/service": "chat"}

    def pods() -> list[Obj] | None:
        found = kube.list("Pod", namespace, selector)
        return found if len(found) >= 2 else None

    found = eventually("engine and router pods admitted", pods, timeout=60)
    names_of = sorted(p["metadata"]["name"].rsplit("-", 2)[0] for p in found)
    assert names_of == ["chat-router", "chat-small"]
    for pod in found:
        keys = [c["topologyKey"] for c in pod["spec"]["topologySpreadConstraints"]]
        assert keys == ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
    stalled = condition(get(kube, "InferenceService", namespace, "chat"), "Stalled")
    assert stalled is None or stalled["status"] == "False"


def _token_volumes(pod: Obj) -> list[str]:
    """The pod's volumes carrying a ServiceAccount token: what the API server's ServiceAccount
    admission adds (``kube-api-access-*``) unless the pod opts out."""
    return [
        volume["name"]
        for volume in pod["spec"].get("volumes", [])
        for source in volume.get("projected", {}).get("sources", [])
        if "serviceAccountToken" in source
    ]


def test_engine_pods_get_their_own_account_and_no_token_and_the_router_keeps_its_own(
    kube: Kube, namespace: str, operator: Any, gpu_node: None
) -> None:
    """Regression (issue 41): engine pods ran as the namespace's default account with its API
    token mounted. The operator creates the service's engine account (owned by the service,
    bound to nothing); the engine pods the real controllers create run as it, and the API
    server's ServiceAccount admission mounts no token in them; the router pod keeps its own
    account's token, which its EndpointSlice discovery needs."""
    apply_service(kube, small_service(namespace))
    account = eventually(
        "engine ServiceAccount", lambda: get(kube, "ServiceAccount", namespace, "chat-engines")
    )
    assert account["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    assert account["automountServiceAccountToken"] is False
    selector = {"fleetpilot.dev/service": "chat"}

    def pods() -> list[Obj] | None:
        found = kube.list("Pod", namespace, selector)
        return found if len(found) >= 2 else None

    by_component = {
        pod["metadata"]["labels"]["app.kubernetes.io/component"]: pod
        for pod in eventually("engine and router pods", pods, timeout=60)
    }
    engine, router = by_component["engine"], by_component["router"]
    assert engine["spec"]["serviceAccountName"] == "chat-engines"
    assert engine["spec"]["automountServiceAccountToken"] is False
    assert _token_volumes(engine) == []
    assert all(
        "/var/run/secrets/kubernetes.io" not in mount["mountPath"]
        for mount in engine["spec"]["containers"][0].get("volumeMounts", [])
    )
    assert router["spec"]["serviceAccountName"] == "chat-router"
    assert _token_volumes(router) != []
    bindings = kube.list("RoleBinding", namespace, selector)
    assert [s["name"] for b in bindings for s in b["subjects"]] == ["chat-router"]


LEASE = "fleetpilot-e2e"
LEASE_DURATION_S = 6


def test_a_standby_operator_takes_over_when_the_leader_is_killed(
    kube: Kube, namespace: str, start_operator: OperatorFactory, tmp_path: Path, gpu_node: None
) -> None:
    """Two operator replicas under the chart's RBAC, one Lease: only the holder reconciles
    (the standby's log shows no reconcile while it waits), and once the leader is killed
    (SIGKILL: no goodbye) the standby takes the Lease within about its duration and acts."""
    campaign = (
        "--leader-election",
        "--leader-election-namespace", namespace,
        "--leader-election-name", LEASE,
        "--lease-duration", str(LEASE_DURATION_S),
    )  # fmt: skip
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{LEASE}"

    def holder() -> str | None:
        try:
            lease = kube.request("GET", lease_path)
        except KubeError as error:
            if error.status == 404:
                return None
            raise
        return (lease or {}).get("spec", {}).get("holderIdentity")

    def reconciles(index: int) -> int:
        lines = (tmp_path / f"operator-{index}.log").read_text().splitlines()
        return sum(1 for line in lines if "reconciled" in line)

    leader = start_operator(*campaign, "--identity", "first")
    eventually("first holds the lease", lambda: holder() == "first" or None)
    start_operator(*campaign, "--identity", "second")  # healthy: a standby serves /healthz
    apply_service(kube, small_service(namespace))
    eventually("engine Deployment", lambda: get(kube, "Deployment", namespace, "chat-small"))
    eventually(
        "status", lambda: condition(get(kube, "InferenceService", namespace, "chat"), "Ready")
    )
    time.sleep(2 * LEASE_DURATION_S / 3)  # time enough for a standby that wrongly acts
    assert reconciles(0) >= 1
    assert reconciles(1) == 0
    assert holder() == "first"

    os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()
    killed = time.monotonic()
    eventually("second holds the lease", lambda: holder() == "second" or None, timeout=60)
    took = time.monotonic() - killed
    print(f"standby took over {took:.1f} s after the leader was killed")
    # Its last renewal, seen unchanged for the lease duration, plus a retry period; the
    # bound leaves room for a busy machine, not for waiting on a second lease.
    assert took < 2 * LEASE_DURATION_S + 5

    # The new leader acts: a changed spec reaches the Deployment.
    changed = small_service(namespace)
    changed["spec"]["tiers"][0]["resources"]["cpu"] = "2"
    apply_service(kube, changed)

    def cpu() -> bool | None:
        deployment = get(kube, "Deployment", namespace, "chat-small")
        assert deployment is not None
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        return container["resources"]["requests"]["cpu"] == "2" or None

    eventually("the new leader's reconcile", cpu)
    eventually("the new leader's log of it", lambda: reconciles(1) >= 1 or None, timeout=10)


def test_unschedulable_pods_are_reported(
    kube: Kube, namespace: str, operator: Any, gpu_node: None
) -> None:
    """A GPU product no node has: the scheduler refuses the engine pod, and Degraded says
    Unschedulable with the pod's name and the scheduler's own words, so no one has to read
    the pod's events to find out why."""
    manifest = small_service(namespace)
    manifest["spec"]["tiers"][0]["resources"]["gpuProduct"] = "NVIDIA-B300"
    apply_service(kube, manifest)

    def degraded() -> Obj | None:
        state = condition(get(kube, "InferenceService", namespace, "chat"), "Degraded")
        return state if state and state["reason"] == "Unschedulable" else None

    state = eventually("Degraded Unschedulable", degraded, timeout=90)
    assert state["status"] == "True"
    # e.g. "pod chat-small-6d9f-x2k: 0/1 nodes are available: 1 node(s) didn't match Pod's
    # node affinity/selector. preemption: ..." (the H100 node lacks the B300 label).
    message = state["message"]
    assert re.match(r"pod chat-small-[a-z0-9]+-[a-z0-9]+: 0/\d+ nodes are available: ", message)
    assert "didn't match Pod's node affinity/selector" in message


def test_reconcile_of_an_unchanged_service_writes_nothing(
    kube: Kube, namespace: str, chart_crds: None, control_plane: Cluster
) -> None:
    """Idempotency, counted: once the cluster has settled, a reconcile performs zero writes."""
    apply_service(kube, small_service(namespace))
    with control_plane.api_client() as api:
        counted = CountingKube(api)
        reconciler = Reconciler(counted)

        def fresh() -> Obj:
            body = counted.get("InferenceService", namespace, "chat")
            assert body is not None
            return body

        assert reconciler.reconcile(fresh()).applied
        # Controllers keep reporting (ReplicaSets, pods, scheduling) for a moment; each report
        # is a real change of status. Wait until a reconcile finds nothing new to record.
        eventually(
            "status settled",
            lambda: None if reconciler.reconcile(fresh()).status_written else True,
        )
        before = counted.writes
        result = reconciler.reconcile(fresh())
        assert result.applied == []
        assert result.pruned == []
        assert not result.status_written
        assert counted.writes == before


def test_operator_restart_mid_rollout_resumes_cleanly(
    kube: Kube, namespace: str, start_operator: OperatorFactory, gpu_node: None
) -> None:
    """A spec changed while the operator is down is picked up when it comes back."""
    first = start_operator()
    manifest = small_service(namespace)
    apply_service(kube, manifest)
    eventually("engine Deployment", lambda: get(kube, "Deployment", namespace, "chat-small"))
    stop(first)
    manifest["spec"]["tiers"][0]["engine"] = {"maxNumSeqs": 64}
    changed = apply_service(kube, manifest)
    start_operator()

    def resumed() -> Obj | None:
        deployment = get(kube, "Deployment", namespace, "chat-small")
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"] if deployment else []
        return deployment if args[args.index("--max-num-seqs") + 1] == "64" else None

    eventually("change applied after restart", resumed)

    def status_current() -> Obj | None:
        current = get(kube, "InferenceService", namespace, "chat")
        generation = changed["metadata"]["generation"]
        observed = (current or {}).get("status", {}).get("observedGeneration")
        return current if observed == generation else None

    eventually("status of the new generation", status_current)


PODMONITOR_CRD: Obj = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"kind": "PodMonitor", "plural": "podmonitors", "singular": "podmonitor"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


@pytest.fixture
def podmonitor_crd(kube: Kube) -> Iterator[None]:
    """The Prometheus Operator's PodMonitor kind, served for one test and removed after."""
    path = f"{CRD_PATH}/podmonitors.monitoring.coreos.com"
    kube.request(
        "PATCH",
        path,
        query=[("fieldManager", "e2e"), ("force", "true")],
        body=PODMONITOR_CRD,
        content_type="application/apply-patch+yaml",
    )
    eventually(
        "PodMonitor served",
        lambda: True if kube.serves("monitoring.coreos.com/v1", "podmonitors") else None,
    )
    try:
        yield
    finally:
        kube.request("DELETE", path)
        eventually(
            "PodMonitor gone",
            lambda: None if kube.serves("monitoring.coreos.com/v1", "podmonitors") else True,
        )


def test_pod_monitor_is_created_when_its_crd_exists(
    kube: Kube, namespace: str, podmonitor_crd: None, start_operator: OperatorFactory
) -> None:
    """With the Prometheus Operator's CRD served at start, each service gets a PodMonitor
    selecting its pods."""
    start_operator()
    apply_service(kube, small_service(namespace))
    monitor = eventually(
        "PodMonitor", lambda: get(kube, "PodMonitor", namespace, "chat-metrics"), timeout=60
    )
    assert monitor["spec"]["selector"]["matchLabels"] == {"fleetpilot.dev/service": "chat"}


def test_no_pod_monitor_without_its_crd(kube: Kube, namespace: str, operator: Any) -> None:
    """The optional CRD's absence never blocks a service: everything else is applied."""
    apply_service(kube, small_service(namespace))
    eventually("router", lambda: get(kube, "Deployment", namespace, "chat-router"))
    assert not kube.serves("monitoring.coreos.com/v1", "podmonitors")


def test_autoscaler_timer_scales_on_prometheus_metrics(
    kube: Kube, namespace: str, start_operator: OperatorFactory, gpu_node: None, tmp_path: Path
) -> None:
    """The operator's autoscaler, end to end: engines report TTFT p95 above the SLO, a real
    Prometheus scrapes them, the timer scales the role up through the autoscaler's own field
    manager and records why in status, and ScalingActive turns True."""
    engine = Engine(EngineKey(namespace, "chat", "small", "unified"))
    engine.drive(Load(ttft_s=(1.5,) * 4, itl_s=(0.02,) * 8, successes=4))
    stop = threading.Event()
    driver = threading.Thread(
        target=lambda: [engine.tick() for _ in iter(lambda: stop.wait(0.1), True)], daemon=True
    )
    driver.start()
    try:
        with PrometheusServer(tmp_path / "prometheus", [engine.target()]) as prometheus:
            prometheus.wait_scraped()
            manifest = small_service(namespace)
            manifest["spec"]["tiers"][0]["autoscaling"] = {
                "interval": "2s",
                "window": "10s",
                "slo": {"ttftP95": "800ms"},
            }
            apply_service(kube, manifest)
            start_operator("--prometheus-url", prometheus.url)

            def scaled() -> Obj | None:
                # Ready pods are the capacity the autoscaler counts: play the kubelet.
                mark_pods_ready(kube, namespace, {"fleetpilot.dev/service": "chat"})
                deployment = get(kube, "Deployment", namespace, "chat-small")
                return deployment if deployment and deployment["spec"]["replicas"] >= 2 else None

            deployment = eventually("scale-up", scaled, timeout=90)
    finally:
        stop.set()
        engine.close()
    owners = [
        entry["manager"]
        for entry in deployment["metadata"]["managedFields"]
        if "f:replicas" in entry.get("fieldsV1", {}).get("f:spec", {})
    ]
    assert owners == [AUTOSCALER_MANAGER]

    def recorded() -> Obj | None:
        # The autoscaler writes /scale, then the service's status: on a busy machine the
        # scale-up is seen a moment before its record.
        service = get(kube, "InferenceService", namespace, "chat")
        roles = service["status"]["tiers"][0]["roles"] if service else []
        return service if roles and "lastScale" in roles[0] else None

    current = eventually("the scale-up recorded in status", recorded, timeout=30)
    (role,) = current["status"]["tiers"][0]["roles"]
    assert role["lastScale"]["fromReplicas"] == 1
    assert "ttft p95" in role["lastScale"]["reason"]
    active = condition(current, "ScalingActive")
    assert active is not None
    assert active["status"] == "True"


# -- NetworkPolicies (issue 12 item 11) ----------------------------------------------------
# Without a CNI nothing enforces a NetworkPolicy, so this checks what the API server can: the
# operator (under the chart's RBAC) applies them and the server accepts them; their selectors,
# evaluated by the API server's own label-selector code on the pods the controllers created,
# pick exactly the right pods (not those of another service in the same namespace); and they
# are pruned and garbage-collected like every other child.

RESOURCES_1GI = {"gpuProduct": H100, "cpu": "1", "memory": "1Gi"}


def policy_manifest(namespace: str, name: str, *, pd: bool, **spec: Any) -> Obj:
    tiers = [make_tier("small", up_to=0.4 if pd else None, resources=RESOURCES_1GI)]
    if pd:
        tiers.append(make_tier("large", mode="disaggregated", resources=RESOURCES_1GI))
    return make_manifest(name, namespace=namespace, tiers=tiers, routing={"replicas": 1}, **spec)


def selector_text(selector: Obj) -> str:
    """A LabelSelector object as the API's labelSelector query (matchLabels, In expressions)."""
    terms = [f"{k}={v}" for k, v in sorted(selector.get("matchLabels", {}).items())]
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        terms.append(f"{expr['key']} in ({','.join(expr['values'])})")
    assert terms, "an empty selector selects everything"
    return ",".join(terms)


def names_selected(kube: Kube, kind: str, namespace: str | None, selector: Obj) -> set[str]:
    path = RESOURCES[kind].path(namespace) if kind != "Namespace" else "/api/v1/namespaces"
    found = kube.request("GET", path, query=[("labelSelector", selector_text(selector))])
    return {item["metadata"]["name"] for item in found.get("items", [])}


def pods_of(kube: Kube, namespace: str, deployments: list[str]) -> set[str]:
    """The pods each Deployment selects for itself: what a policy must match, found without
    the policy's labels."""
    pods: set[str] = set()
    for name in deployments:
        deployment = get(kube, "Deployment", namespace, name)
        assert deployment is not None, name
        pods |= names_selected(kube, "Pod", namespace, deployment["spec"]["selector"])
    return pods


def no_policies(kube: Kube, namespace: str, service: str) -> bool | None:
    left = kube.list("NetworkPolicy", namespace, {"fleetpilot.dev/service": service})
    return True if not left else None


def test_policies_select_exactly_the_services_pods_and_are_pruned_and_collected(
    kube: Kube, namespace: str, operator: Any
) -> None:
    """The NetworkPolicies are accepted by the API server, select exactly this service's
    engine and router pods (not another service's in the namespace), admit only its router,
    its engines and the metrics namespace, are pruned on opt-out and collected on delete."""
    scraped_by_this_namespace = {"metricsNamespaces": [namespace]}
    apply_service(
        kube, policy_manifest(namespace, "chat", pd=True, networkPolicy=scraped_by_this_namespace)
    )
    apply_service(kube, policy_manifest(namespace, "other", pd=False))
    engines = ["chat-small", "chat-large-prefill", "chat-large-decode"]
    all_deployments = [*engines, "chat-router", "other-small", "other-router"]

    def pods_created() -> bool | None:
        for name in all_deployments:
            if get(kube, "Deployment", namespace, name) is None:
                return None
        return True if len(pods_of(kube, namespace, all_deployments)) == 6 else None

    eventually("every Deployment's pod", pods_created, timeout=120)
    engine_pods = pods_of(kube, namespace, engines)
    router_pods = pods_of(kube, namespace, ["chat-router"])
    assert len(engine_pods) == 3
    assert len(router_pods) == 1

    # Stored as planned: the API server's validation and defaulting accepted the objects.
    policy = eventually(
        "engines policy", lambda: get(kube, "NetworkPolicy", namespace, "chat-engines")
    )
    router_policy = get(kube, "NetworkPolicy", namespace, "chat-router")
    assert router_policy is not None
    assert policy["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"

    # Who is guarded: exactly this service's engine pods; its router pod by its own policy.
    assert names_selected(kube, "Pod", namespace, policy["spec"]["podSelector"]) == engine_pods
    guarded_routers = names_selected(kube, "Pod", namespace, router_policy["spec"]["podSelector"])
    assert guarded_routers == router_pods
    # The router's API port to anyone; its metrics port to the service's router pods (their
    # peer exchange) and the metrics namespace only.
    to_all, to_routers, to_scrapers = router_policy["spec"]["ingress"]
    assert to_all == {"ports": [{"protocol": "TCP", "port": 8000}]}
    assert to_routers["ports"] == [{"protocol": "TCP", "port": 9090}]
    (router_peer,) = to_routers["from"]
    assert names_selected(kube, "Pod", namespace, router_peer["podSelector"]) == router_pods
    assert to_scrapers["ports"] == [{"protocol": "TCP", "port": 9090}]
    (router_scraper,) = to_scrapers["from"]
    assert names_selected(kube, "Namespace", None, router_scraper["namespaceSelector"]) == {
        namespace
    }
    # Who gets in: the router rule admits only this service's router pod, the peer rule only
    # its engine pods (not "other"'s, in the same namespace), the scrape rule one namespace.
    from_router, from_peers, from_scrapers = policy["spec"]["ingress"]
    # The HTTP port and the KV-event publisher and replay ports (the router subscribes).
    assert from_router["ports"] == [
        {"protocol": "TCP", "port": port} for port in (8000, 5557, 5558)
    ]
    (router_peer,) = from_router["from"]
    assert names_selected(kube, "Pod", namespace, router_peer["podSelector"]) == router_pods
    assert "ports" not in from_peers
    (engine_peer,) = from_peers["from"]
    assert names_selected(kube, "Pod", namespace, engine_peer["podSelector"]) == engine_pods
    (scraper,) = from_scrapers["from"]
    selected = names_selected(kube, "Namespace", None, scraper["namespaceSelector"])
    assert selected == {namespace}

    # Opting out prunes both policies (the other service keeps its own).
    apply_service(
        kube, policy_manifest(namespace, "chat", pd=True, networkPolicy={"enabled": False})
    )
    eventually("chat's policies pruned", lambda: no_policies(kube, namespace, "chat"))
    assert get(kube, "NetworkPolicy", namespace, "other-engines") is not None

    # Deleting the service takes its policies with it (garbage collection by owner).
    kube.delete("InferenceService", namespace, "other")
    eventually("other's policies collected", lambda: no_policies(kube, namespace, "other"), 90)


# -- LoRA adapters: a changed list rolls static engines, and reaches dynamic ones in place ---

# The engine pod's address, played by a reference engine on this machine: loopback addresses
# other than 127.0.0.1 keep the engine port (8000, the pod's) clear of anything else here.
ENGINE_POD_IP = "127.0.0.77"


def lora_service(namespace: str, adapters: list[str], *, dynamic: bool) -> Obj:
    """One tier serving adapters from the PVC `loras`, loaded at start or at run time."""
    manifest = small_service(namespace)
    tier = manifest["spec"]["tiers"][0]
    tier["serving"] = {"replicas": {"min": 1, "max": 1}}
    tier["adapters"] = [
        {"name": name, "source": {"pvc": {"claimName": "loras", "path": name}}} for name in adapters
    ]
    tier["lora"] = {"maxLoras": 2, "dynamic": dynamic}
    return manifest


@contextlib.contextmanager
def volume_for_claim(
    kube: Kube, namespace: str, name: str, access_mode: str, path: Path
) -> Iterator[str]:
    """A hostPath PV made for the claim ``name`` (no provisioner here; the scheduler places no
    pod whose claim is missing or unbound), whoever creates the claim; deleted after."""
    volume = f"{namespace}-{name}"
    kube.request("POST", "/api/v1/persistentvolumes", body={
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
        "spec": {
            "capacity": {"storage": "1Gi"}, "accessModes": [access_mode],
            "storageClassName": "", "hostPath": {"path": str(path)},
            "claimRef": {"namespace": namespace, "name": name},
        },
    })  # fmt: skip
    try:
        yield volume
    finally:
        kube.request("DELETE", f"/api/v1/persistentvolumes/{volume}")


@contextlib.contextmanager
def bound_claim(
    kube: Kube, namespace: str, name: str, access_mode: str, path: Path
) -> Iterator[str]:
    """The PVC ``name``, bound to a hostPath PV made for it."""
    with volume_for_claim(kube, namespace, name, access_mode, path) as volume:
        kube.request("POST", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims", body={
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {
                "accessModes": [access_mode], "storageClassName": "", "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        })  # fmt: skip

        def bound() -> bool | None:
            path = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}"
            return (kube.request("GET", path) or {}).get("status", {}).get(
                "phase"
            ) == "Bound" or None

        eventually(f"the claim {name} bound", bound)
        yield name


@pytest.fixture
def adapter_claim(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[None]:
    """The PVC `loras` the adapters are read from."""
    with bound_claim(kube, namespace, "loras", "ReadOnlyMany", tmp_path / "loras"):
        yield


@pytest.fixture
def pod_engine(tmp_path: Path) -> Iterator[tuple[BackgroundServer, Path]]:
    """A reference engine standing in for the tier's one engine pod: LoRA on, vLLM's runtime
    load/unload endpoints on, reading the pod's paths under ``root`` (its volume mounts)."""
    root = tmp_path / "pod"
    for seed, name in enumerate(("tax", "legal"), start=1):
        adapter, tensors = random_adapter(MODEL_PRESETS["tiny"], 8, 16, seed=seed)
        save_adapter(root / "adapter-volumes" / "loras" / name, adapter, tensors)
    argv = ["--host", ENGINE_POD_IP, "--port", str(ENGINE_PORT), "--model-config", "tiny",
            "--served-model-name", "small-model", "--enable-lora", "--max-loras", "2",
            "--adapter-path-root", str(root)]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        server = BackgroundServer.from_argv(argv).start()
    try:
        yield server, root
    finally:
        server.stop()


def test_a_changed_adapter_list_reaches_dynamic_engines_without_a_rollout(
    kube: Kube,
    namespace: str,
    operator: Any,
    gpu_node: None,
    adapter_claim: None,
    pod_engine: tuple[BackgroundServer, Path],
) -> None:
    """`lora.dynamic`: the operator loads the listed adapters into the Ready engine pod over
    vLLM's endpoints; a changed list is unloaded and loaded there, and the Deployment's
    template (so its pods) stays as it was."""
    engine, _ = pod_engine
    adapters = AdapterClient()
    apply_service(kube, lora_service(namespace, ["tax"], dynamic=True))
    deployment = eventually(
        "engine Deployment", lambda: get(kube, "Deployment", namespace, "chat-small")
    )
    selector = names.engine_selector("chat", "small", "unified")
    eventually(
        "engine pod Ready",
        lambda: mark_pods_ready(kube, namespace, selector, ENGINE_POD_IP) or None,
    )

    def holds(expected: dict[str, str]) -> bool | None:
        return adapters.listed(engine.url) == expected or None

    eventually("tax loaded into the engine", lambda: holds({"tax": "/adapter-volumes/loras/tax"}))

    apply_service(kube, lora_service(namespace, ["legal"], dynamic=True))
    eventually(
        "the changed list in the engine",
        lambda: holds({"legal": "/adapter-volumes/loras/legal"}),
    )
    after = get(kube, "Deployment", namespace, "chat-small")
    assert after is not None
    assert after["metadata"]["generation"] == deployment["metadata"]["generation"]
    assert after["spec"]["template"] == deployment["spec"]["template"]
    (pod,) = kube.list("Pod", namespace, selector)  # the same pod: nothing rolled
    reasons = {e["reason"] for e in kube.list("Event", namespace, {})}
    assert "AdaptersSynced" in reasons
    assert pod["status"]["podIP"] == ENGINE_POD_IP
    adapters.close()


def test_a_changed_adapter_list_rolls_static_engines(
    kube: Kube, namespace: str, operator: Any, gpu_node: None, adapter_claim: None
) -> None:
    """Without `lora.dynamic` the list is the engines' --lora-modules: a change is a new pod
    template, which the Deployment rolls out."""
    apply_service(kube, lora_service(namespace, ["tax"], dynamic=False))
    before = eventually(
        "engine Deployment", lambda: get(kube, "Deployment", namespace, "chat-small")
    )
    assert (
        "tax=/adapter-volumes/loras/tax"
        in before["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    apply_service(kube, lora_service(namespace, ["legal"], dynamic=False))

    def rolled() -> Obj | None:
        deployment = get(kube, "Deployment", namespace, "chat-small")
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"] if deployment else []
        return deployment if "legal=/adapter-volumes/loras/legal" in args else None

    after = eventually("the new list in the pod template", rolled)
    assert after["metadata"]["generation"] > before["metadata"]["generation"]


# -- Cold start measured (issue 19 item 3) --------------------------------------------------


def cold_start_metric(port: int, namespace: str) -> dict[tuple[str, str], float]:
    """The operator's ``fleetpilot_operator_engine_cold_start_seconds`` _count and _sum of the
    test's service (tier small, role unified), by (phase, count|sum)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, trust_env=False).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("fleetpilot_operator_engine_cold_start_seconds_"):
                continue
            labels = sample.labels
            if (labels["namespace"], labels["service"]) != (namespace, "chat"):
                continue
            assert (labels["tier"], labels["role"]) == ("small", "unified")
            kind = sample.name.rsplit("_", 1)[1]
            if kind in ("count", "sum"):
                found[(labels["phase"], kind)] = sample.value
    return found


def test_cold_start_is_measured_from_the_pods_timestamps_and_outlives_pods_and_operators(
    kube: Kube, namespace: str, start_operator: OperatorFactory, gpu_node: None
) -> None:
    """The harness (the kubelet) reports the engine pod's container started 30 s after the
    pod was created and Ready 42 s later: the status shows startSeconds 42 and podSeconds 72,
    and the operator's histogram observed both once. Then, with the operator stopped, the pod
    goes; its replacement starts in 15 s under a new operator: the status keeps both starts
    (p50 15, max 42), and the new operator observes only the new one."""
    (metrics_port,) = free_ports(1)
    first = start_operator("--metrics-port", str(metrics_port))
    apply_service(kube, small_service(namespace))
    engines = {"fleetpilot.dev/service": "chat", "fleetpilot.dev/tier": "small"}

    def scheduled_pod(other_than: str = "") -> Obj | None:
        for pod in kube.list("Pod", namespace, engines):
            name = pod["metadata"]["name"]
            deleting = pod["metadata"].get("deletionTimestamp")
            if pod["spec"].get("nodeName") and name != other_than and not deleting:
                return pod
        return None

    def created(pod: Obj) -> datetime:
        return datetime.fromisoformat(pod["metadata"]["creationTimestamp"])

    def cold_start(count: int) -> Obj | None:
        current = get(kube, "InferenceService", namespace, "chat")
        roles = (current or {}).get("status", {}).get("tiers", [{}])[0].get("roles", [{}])
        found = roles[0].get("coldStart") if roles else None
        return found if found and found["count"] == count else None

    pod = eventually("engine pod scheduled", scheduled_pod)
    name, since = pod["metadata"]["name"], created(pod)
    started_at, ready_at = since + timedelta(seconds=30), since + timedelta(seconds=72)
    assert mark_pods_ready(kube, namespace, engines, started_at=started_at, ready_at=ready_at)
    measured = eventually("cold start in status", lambda: cold_start(1))
    stamp = "%Y-%m-%dT%H:%M:%SZ"
    assert measured == {
        "count": 1,
        "start": {"count": 1, "p50Seconds": 42, "maxSeconds": 42},
        "pod": {"count": 1, "p50Seconds": 72, "maxSeconds": 72},
        "samples": [
            {
                "pod": name,
                "startedAt": started_at.strftime(stamp),
                "readyAt": ready_at.strftime(stamp),
                "startSeconds": 42,
                "podSeconds": 72,
            }
        ],
    }
    # Observed right after the status write that recorded it returned.
    eventually("observed", lambda: cold_start_metric(metrics_port, namespace) or None, timeout=10)
    assert cold_start_metric(metrics_port, namespace) == {
        ("start", "count"): 1.0,
        ("start", "sum"): 42.0,
        ("pod", "count"): 1.0,
        ("pod", "sum"): 72.0,
    }

    def router_holds_for() -> float | None:
        config_map = get(kube, "ConfigMap", namespace, "chat-router")
        if config_map is None:
            return None
        config = RouterConfig.model_validate(yaml.safe_load(config_map["data"][ROUTER_CONFIG_FILE]))
        observed = config.tiers[0].cold_start_observed
        return observed.total_seconds() if observed is not None else None

    # No spec change: the new cold start alone re-reconciles, so the router's hold knows it.
    assert eventually("the router's config has the cold start", router_holds_for) == 72.0

    stop(first)
    kube.request(
        "DELETE",
        f"/api/v1/namespaces/{namespace}/pods/{name}",
        body={"gracePeriodSeconds": 0},
    )
    (metrics_port,) = free_ports(1)
    start_operator("--metrics-port", str(metrics_port))
    replacement = eventually("replacement pod scheduled", lambda: scheduled_pod(name))
    since = created(replacement)
    started_at, ready_at = since + timedelta(seconds=10), since + timedelta(seconds=25)
    assert mark_pods_ready(kube, namespace, engines, started_at=started_at, ready_at=ready_at)
    both = eventually("second cold start in status", lambda: cold_start(2))
    samples = {s["pod"]: (s["startSeconds"], s["podSeconds"]) for s in both["samples"]}
    assert samples == {name: (42, 72), replacement["metadata"]["name"]: (15, 25)}
    assert both["start"] == {"count": 2, "p50Seconds": 15, "maxSeconds": 42}
    assert both["pod"] == {"count": 2, "p50Seconds": 25, "maxSeconds": 72}
    eventually("observed", lambda: cold_start_metric(metrics_port, namespace) or None, timeout=10)
    assert cold_start_metric(metrics_port, namespace) == {
        ("start", "count"): 1.0,
        ("start", "sum"): 15.0,
        ("pod", "count"): 1.0,
        ("pod", "sum"): 25.0,
    }


@pytest.fixture
def cache_claim(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[str]:
    """A ReadWriteMany claim `model-cache` for spec.modelCache.claimName."""
    with bound_claim(kube, namespace, "model-cache", "ReadWriteMany", tmp_path / "cache") as name:
        yield name


def test_engines_wait_for_the_model_download_and_a_second_replica_downloads_nothing(
    kube: Kube, namespace: str, operator: Any, gpu_node: None, cache_claim: str
) -> None:
    """With spec.modelCache the operator creates one download Job and no engine Deployment
    (ModelReady=False, Downloading); the Job's pod finishing (the harness plays the kubelet,
    the real Job controller completes the Job) brings the engine Deployment, reading the
    cache offline; a second replica starts from the same cache: still one Job, one pod."""
    manifest = small_service(namespace, modelCache={"claimName": cache_claim})
    manifest["spec"]["tiers"][0]["model"]["source"] = {"huggingface": {"revision": "r1"}}
    apply_service(kube, manifest)
    fetch = {names.LABEL_SERVICE: "chat", names.LABEL_COMPONENT: "model-fetch"}
    (job,) = eventually("the download Job", lambda: kube.list("Job", namespace, fetch) or None)
    job_name = job["metadata"]["name"]
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:5] == ["fleetpilot", "model", "fetch", "hub", "--repo"]
    assert "r1" in command

    def model_ready(status: str) -> Obj | None:
        current = get(kube, "InferenceService", namespace, "chat")
        found = condition(current, "ModelReady")
        return found if found is not None and found["status"] == status else None

    downloading = eventually("ModelReady=False", lambda: model_ready("False"))
    assert downloading["reason"] == "Downloading"
    eventually("the router", lambda: get(kube, "Deployment", namespace, "chat-router"))
    assert get(kube, "Deployment", namespace, "chat-small") is None

    eventually("the Job's pod finished", lambda: finish_job_pods(kube, namespace, job_name) or None)
    deployment = eventually(
        "the engine Deployment", lambda: get(kube, "Deployment", namespace, "chat-small"), 90
    )
    assert eventually("ModelReady=True", lambda: model_ready("True"))["reason"] == "Downloaded"
    pod = deployment["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "initContainers" not in pod

    kube.request(
        "PATCH",
        f"/apis/apps/v1/namespaces/{namespace}/deployments/chat-small/scale",
        body={"spec": {"replicas": 2}},
        content_type=MERGE_CONTENT_TYPE,
    )
    selector = {names.LABEL_SERVICE: "chat", names.LABEL_TIER: "small"}
    eventually(
        "two engine pods Ready", lambda: mark_pods_ready(kube, namespace, selector) >= 2 or None
    )
    assert [j["metadata"]["name"] for j in kube.list("Job", namespace, fetch)] == [job_name]
    job_pods = kube.list("Pod", namespace, {"batch.kubernetes.io/job-name": job_name})
    assert len(job_pods) == 1
    # A named claim may be shared: no GC Job removes what other services may read there.
    gc = {names.LABEL_SERVICE: "chat", names.LABEL_COMPONENT: "model-gc"}
    assert kube.list("Job", namespace, gc) == []


@pytest.fixture
def owned_cache_volume(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[None]:
    """A PV for the claim the operator creates for spec.modelCache.size (chat-model-cache)."""
    with volume_for_claim(kube, namespace, "chat-model-cache", "ReadWriteMany", tmp_path / "c"):
        yield


def test_a_new_revision_rolls_the_tier_then_a_gc_job_removes_the_old_one(
    kube: Kube, namespace: str, operator: Any, gpu_node: None, owned_cache_volume: None
) -> None:
    """In a cache the operator created, a new revision is a new download Job (the old one is
    pruned) while the engines keep the old revision; once it completes the tier rolls, and once
    no pod of the old revision is left a GC Job runs, keeping only the new revision."""
    manifest = small_service(namespace, modelCache={"size": "1Gi"})
    manifest["spec"]["tiers"][0]["model"]["source"] = {"huggingface": {"revision": "r1"}}
    apply_service(kube, manifest)
    fetch = {names.LABEL_SERVICE: "chat", names.LABEL_COMPONENT: "model-fetch"}
    gc = {names.LABEL_SERVICE: "chat", names.LABEL_COMPONENT: "model-gc"}
    engines = {names.LABEL_SERVICE: "chat", names.LABEL_TIER: "small"}

    def jobs(selector: dict[str, str]) -> list[str] | None:
        return [j["metadata"]["name"] for j in kube.list("Job", namespace, selector)] or None

    def keeps(job: str) -> list[str]:
        command = (get(kube, "Job", namespace, job) or {})["spec"]["template"]["spec"]
        argv = command["containers"][0]["command"]
        return [f"{flag} {value}" for flag, value in pairwise(argv) if flag.startswith("--keep-")]

    def engine_args() -> list[str]:
        live = get(kube, "Deployment", namespace, "chat-small") or {}
        return live["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[no-any-return]

    (r1,) = eventually("the download of r1", lambda: jobs(fetch))
    eventually("r1 downloaded", lambda: finish_job_pods(kube, namespace, r1) or None)
    eventually("the engine pod", lambda: mark_pods_ready(kube, namespace, engines) or None, 90)
    # The Deployment's first pods read r1 only: the GC Job (nothing to remove yet) follows.
    (first_gc,) = eventually("the GC Job keeping r1", lambda: jobs(gc))
    model = manifest["spec"]["tiers"][0]["model"]["name"]
    assert keeps(first_gc) == [f"--keep-hub {model}@r1"]

    manifest["spec"]["tiers"][0]["model"]["source"] = {"huggingface": {"revision": "r2"}}
    apply_service(kube, manifest)

    def only_r2() -> list[str] | None:
        found, collecting = jobs(fetch), jobs(gc)
        return found if found and r1 not in found and not collecting else None

    # The old download and the GC Job keeping it are pruned; the engines keep r1 meanwhile.
    (r2,) = eventually("the download of r2 alone, the GC Job of r1 pruned", only_r2)
    assert "r1" in engine_args()

    eventually("r2 downloaded", lambda: finish_job_pods(kube, namespace, r2) or None)

    def rolling() -> bool | None:
        live = get(kube, "Deployment", namespace, "chat-small") or {}
        status = live.get("status", {})
        old_pods = status.get("replicas", 0) - status.get("updatedReplicas", 0)
        return ("r2" in engine_args() and old_pods > 0) or None

    eventually("the tier rolling to r2, the r1 pod still serving", rolling, 90)
    assert jobs(gc) is None  # the r1 pod could start again: its files stay
    eventually("the r2 pod Ready", lambda: mark_pods_ready(kube, namespace, engines) > 1 or None)
    (second_gc,) = eventually("the GC Job keeping r2", lambda: jobs(gc), 90)
    assert keeps(second_gc) == [f"--keep-hub {model}@r2"]
    assert jobs(fetch) == [r2]


def multi_node_service(namespace: str) -> Obj:
    """One tier whose replica is a model copy over 2 nodes of 8 GPUs (tensor 8 x pipeline 2)."""
    tier = make_tier(
        "small",
        parallelism={"tensor": 8, "pipeline": 2},
        resources={"gpuProduct": H100, "cpu": "1", "memory": "1Gi"},
        serving={"replicas": {"min": 1, "max": 4}},
    )
    return make_manifest("chat", namespace=namespace, tiers=[tier], routing={"replicas": 1})


def test_a_multi_node_tier_becomes_a_leader_worker_set_ready_by_its_groups(
    kube: Kube,
    namespace: str,
    leader_worker_set_crd: None,
    start_operator: OperatorFactory,
    gpu_node: None,
) -> None:
    """With LeaderWorkerSet served at start, a tier larger than a node is applied as a set of
    2-pod groups with a Service of its leaders; the role's replicas and readiness in status
    are the groups the set's status reports (the test writes it, playing the controller);
    the autoscaler's scale of the set survives a re-applied spec."""
    start_operator()
    manifest = multi_node_service(namespace)
    apply_service(kube, manifest)
    lws = eventually(
        "LeaderWorkerSet", lambda: get(kube, "LeaderWorkerSet", namespace, "chat-small")
    )
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    leaders = eventually(
        "leaders' Service", lambda: get(kube, "Service", namespace, "chat-small-leaders")
    )
    assert leaders["spec"]["selector"][names.LWS_WORKER_INDEX_LABEL] == "0"
    assert get(kube, "Deployment", namespace, "chat-small") is None

    def role_status() -> Obj | None:
        current = get(kube, "InferenceService", namespace, "chat")
        tiers = (current or {}).get("status", {}).get("tiers") or []
        return tiers[0]["roles"][0] if tiers else None

    assert eventually("role status", role_status)["ready"] == 0
    # The controller's part: the group created and Ready (its pods would be, on real nodes).
    generation = lws["metadata"]["generation"]
    kube.patch_status(
        "LeaderWorkerSet",
        namespace,
        "chat-small",
        {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": generation},
        "e2e-lws-controller",
    )
    eventually(
        "router pod scheduled",
        lambda: mark_pods_ready(kube, namespace, {"fleetpilot.dev/service": "chat"}) or None,
    )

    def ready() -> Obj | None:
        mark_pods_ready(kube, namespace, {"fleetpilot.dev/service": "chat"})
        current = get(kube, "InferenceService", namespace, "chat")
        state = condition(current, "Ready")
        return current if state and state["status"] == "True" else None

    current = eventually("Ready=True from the set's groups", ready, timeout=90)
    role = current["status"]["tiers"][0]["roles"][0]
    assert (role["replicas"], role["ready"]) == (1, 1)

    # The autoscaler's field manager scales groups through /scale; a GitOps re-apply of a
    # changed spec reaches the template and leaves the groups alone.
    kube.request(
        "PATCH",
        RESOURCES["LeaderWorkerSet"].path(namespace, "chat-small") + "/scale",
        query=[("fieldManager", AUTOSCALER_MANAGER)],
        body={"spec": {"replicas": 3}},
        content_type=MERGE_CONTENT_TYPE,
    )
    changed = copy.deepcopy(manifest)
    changed["spec"]["tiers"][0]["engine"] = {"env": [{"name": "EXTRA", "value": "1"}]}
    apply_service(kube, changed)

    def rolled() -> Obj | None:
        live = get(kube, "LeaderWorkerSet", namespace, "chat-small")
        leader = live["spec"]["leaderWorkerTemplate"]["leaderTemplate"] if live else {}
        env = leader["spec"]["containers"][0]["env"] if live else []
        return live if any(e["name"] == "EXTRA" for e in env) else None

    assert eventually("spec change applied to the set", rolled)["spec"]["replicas"] == 3


def test_a_multi_node_tier_without_leader_worker_set_is_degraded(
    kube: Kube, namespace: str, operator: Any
) -> None:
    """Without the LeaderWorkerSet API, a tier larger than a node is refused: Degraded and
    Stalled with a reason naming LeaderWorkerSet, the message the numbers, nothing applied."""
    assert not kube.serves("leaderworkerset.x-k8s.io/v1", "leaderworkersets")
    apply_service(kube, multi_node_service(namespace))

    def degraded() -> Obj | None:
        current = get(kube, "InferenceService", namespace, "chat")
        state = condition(current, "Degraded")
        return current if state and state["status"] == "True" else None

    current = eventually("Degraded", degraded)
    state = condition(current, "Degraded")
    assert state is not None
    assert state["reason"] == "LeaderWorkerSetMissing"
    assert "needs 2 nodes per replica (16 GPUs, resources.gpusPerNode 8)" in state["message"]
    stalled = condition(current, "Stalled")
    assert stalled is not None
    assert (stalled["status"], stalled["reason"]) == ("True", "LeaderWorkerSetMissing")
    assert kube.list("Deployment", namespace, {"fleetpilot.dev/service": "chat"}) == []
    assert kube.list("Service", namespace, {"fleetpilot.dev/service": "chat"}) == []


@pytest.mark.parametrize("example", ["deepseek-wide-ep.yaml", "llama-405b-multinode.yaml"])
def test_the_multi_node_examples_reconcile_to_leader_worker_sets_with_their_command_lines(
    kube: Kube,
    namespace: str,
    leader_worker_set_crd: None,
    start_operator: OperatorFactory,
    example: str,
) -> None:
    """Each multi-node example, applied as a user would, becomes the LeaderWorkerSets the
    planner plans: the leader's and the workers' vllm serve lines as planned, the group size,
    and every one-node role a Deployment."""
    start_operator()
    manifest = yaml.safe_load((Path(__file__).parents[1] / "examples" / example).read_text())
    manifest["metadata"]["namespace"] = namespace
    live = apply_service(kube, manifest)
    service = parse_service(live)
    for role in all_roles(service):
        kind, name = names.engine_workload(service.name, role)
        obj = eventually(f"{kind} {name}", lambda k=kind, n=name: get(kube, k, namespace, n))
        if kind == "Deployment":
            continue
        template = obj["spec"]["leaderWorkerTemplate"]
        assert template["size"] == role_layout(role).nodes
        for pod, worker in (
            (template["leaderTemplate"], False),
            (template["workerTemplate"], True),
        ):
            container = pod["spec"]["containers"][0]
            planned = engine_command(service, role, worker=worker)
            # The pod runs the model from its mount; the summary's line names the source.
            assert container["command"] + container["args"][1:] == planned[:2] + planned[3:]


GATEWAY = {
    "parentRefs": [{"name": "inference-gateway", "sectionName": "http"}],
    "hostnames": ["chat.example.com"],
}


def holds(accepted: Any, sent: Any) -> bool:
    """Whether ``accepted`` has everything ``sent`` has (dicts may have more keys)."""
    if isinstance(sent, dict):
        return isinstance(accepted, dict) and all(
            key in accepted and holds(accepted[key], value) for key, value in sent.items()
        )
    if isinstance(sent, list):
        return (
            isinstance(accepted, list)
            and len(accepted) == len(sent)
            and all(holds(a, b) for a, b in zip(accepted, sent, strict=True))
        )
    return bool(accepted == sent)


def test_every_gateway_object_passes_the_official_schemas(
    kube: Kube, namespace: str, gateway_crds: None
) -> None:
    """Server-side dry runs (strict field validation) of everything ``routing.gateway`` plans,
    its every field set, against the Inference Extension's and the Gateway API's own CRDs
    (their CEL rules included): the InferencePool, the HTTPRoute, and the router Service and
    NetworkPolicies that changed with them."""
    gateway = {
        **GATEWAY,
        "parentRefs": [
            {"name": "inference-gateway", "namespace": "gateways", "sectionName": "http"},
            {"name": "internal"},
        ],
        "hostnames": ["chat.example.com", "*.chat.example.com"],
        "failureMode": "FailOpen",
        "proxyNamespaces": ["gateways"],
    }
    service = parse_service(small_service(namespace, routing={"replicas": 1, "gateway": gateway}))
    objects = plan(service, PlanOptions())
    kinds = set()
    for obj in objects:
        if obj["kind"] not in ("InferencePool", "HTTPRoute", "Service", "NetworkPolicy"):
            continue
        kinds.add(obj["kind"])
        resource = RESOURCES[obj["kind"]]
        path = resource.path(namespace, obj["metadata"]["name"])
        accepted = apply(kube, path, obj, dry_run=True)
        # Kept as sent (no field pruned or rewritten), the schema's defaults added around it.
        assert holds(accepted["spec"], obj["spec"]), obj["kind"]
    assert kinds == {"InferencePool", "HTTPRoute", "Service", "NetworkPolicy"}


def test_a_gateway_service_gets_a_pool_and_route_and_reports_what_its_gateway_says(
    kube: Kube, namespace: str, gateway_crds: None, start_operator: OperatorFactory
) -> None:
    """The done-when of issue 45's second part: `routing.gateway` applied, the operator (the
    chart's RBAC) writes an InferencePool and HTTPRoute the real API server accepts; the
    service says GatewayAccepted Unknown until a gateway controller - played here - writes the
    pool's parents, then True from the operator's watch of the pool."""
    start_operator()
    apply_service(kube, small_service(namespace, routing={"replicas": 1, "gateway": GATEWAY}))
    pool = eventually(
        "InferencePool", lambda: get(kube, "InferencePool", namespace, "chat"), timeout=60
    )
    # The official schema's defaults filled in; the picker is the router's Service port.
    assert pool["spec"]["appProtocol"] == "http"
    picker = pool["spec"]["endpointPickerRef"]
    router = get(kube, "Service", namespace, names.router_name("chat"))
    assert router is not None
    assert picker["port"]["number"] in [p["port"] for p in router["spec"]["ports"]]
    route = eventually("HTTPRoute", lambda: get(kube, "HTTPRoute", namespace, "chat"))
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"][0]["name"] == "chat"
    assert rule["backendRefs"][0]["weight"] == 1  # the Gateway API's default

    def gateway_condition() -> Obj | None:
        return condition(get(kube, "InferenceService", namespace, "chat"), "GatewayAccepted")

    pending = eventually("GatewayAccepted", gateway_condition, timeout=60)
    assert (pending["status"], pending["reason"]) == ("Unknown", "NoParent")
    status = {
        "parents": [
            {
                "parentRef": {"name": "inference-gateway"},
                "controllerName": "example.com/test-gateway",
                "conditions": [
                    {
                        "type": kind,
                        "status": "True",
                        "reason": kind,
                        "message": "",
                        "lastTransitionTime": "2026-12-06T16:00:00Z",
                        "observedGeneration": pool["metadata"]["generation"],
                    }
                    for kind in ("Accepted", "ResolvedRefs")
                ],
            }
        ]
    }
    kube.request(
        "PATCH",
        RESOURCES["InferencePool"].path(namespace, "chat") + "/status",
        body={"status": status},
        content_type=MERGE_CONTENT_TYPE,
    )

    def accepted() -> Obj | None:
        seen = gateway_condition()
        return seen if seen is not None and seen["status"] == "True" else None

    done = eventually("GatewayAccepted True", accepted, timeout=60)
    assert done["message"] == f"accepted by Gateway {namespace}/inference-gateway"
