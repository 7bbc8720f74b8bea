"""Fixtures for tests that need a real Kubernetes control plane.

By default the session starts its own control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler built by e2e/controlplane/build.sh) on loopback and
stops it at the end. With FLEETPILOT_E2E_CLUSTER=1 and KUBECONFIG set, the same tests run against
that cluster instead (kind, a real GPU cluster); tests that need fake GPU nodes then skip.

The first build of the binaries takes 10-25 minutes on 2 cores; run pytest with -s to watch it,
or run e2e/controlplane/build.sh beforehand.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from kubernetes import client as k8s

from e2e.chart_support import CHART, CRD_PATH, apply, install_crds, install_definitions
from fleetpilot.kube.client import Kube
from fleetpilot.operator.reconcile import OPTIONAL_KINDS
from fleetpilot.testing.cluster import Cluster, ExistingCluster
from fleetpilot.testing.controlplane import ControlPlane
from fleetpilot.testing.polling import eventually
from fleetpilot.testing.processnode import ProcessNode, skip_reason


def pytest_configure(config: pytest.Config) -> None:
    # Also registered in pyproject; repeated here so `pytest e2e/` works from any rootdir.
    config.addinivalue_line(
        "markers", "cluster: needs the real Kubernetes control plane built from e2e/controlplane"
    )


def use_existing_cluster() -> bool:
    """Whether the suite targets KUBECONFIG's cluster rather than starting its own."""
    return os.environ.get("FLEETPILOT_E2E_CLUSTER") == "1"


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The cluster under test, shared by the whole session (starting one takes seconds)."""
    if use_existing_cluster():
        yield ExistingCluster.from_env()
        return
    plane = ControlPlane(tmp_path_factory.mktemp("controlplane"))
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()
        # stop() raises if a process survives; this double-checks the process groups.
        assert plane.leftover_processes() == []


@pytest.fixture
def k8s_api(control_plane: Cluster) -> Iterator[k8s.ApiClient]:
    """An admin API client, closed after the test."""
    with control_plane.api_client() as api:
        yield api


# How long a test namespace's teardown keeps deleting pods a ReplicaSet may still be making.
NAMESPACE_DRAIN_S = 30.0


@pytest.fixture
def namespace(k8s_api: k8s.ApiClient) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards, so tests never see each other's objects."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    core = k8s.CoreV1Api(k8s_api)
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))
    yield name
    # Without a kubelet, a bound pod's graceful deletion never completes, and the scheduler
    # keeps counting its GPUs: the fake nodes would fill up test by test. Delete the
    # namespace's pods at once, as a kubelet would after their containers stopped - after
    # their Deployments and ReplicaSets, or these make new pods that the namespace's own
    # (graceful) deletion then leaves holding GPUs for good (it filled the 8-GPU node in a
    # full run once tests scaled roles to 3 replicas).
    apps = k8s.AppsV1Api(k8s_api)
    apps.delete_collection_namespaced_deployment(name)
    apps.delete_collection_namespaced_replica_set(name)
    deadline = time.monotonic() + NAMESPACE_DRAIN_S
    while True:
        core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
        if not core.list_namespaced_pod(name).items or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    core.delete_namespace(name)


@pytest.fixture(scope="session")
def kube(control_plane: Cluster) -> Iterator[Kube]:
    """An admin REST client shared by the session (fleetpilot's own client, as the operator's)."""
    with control_plane.api_client() as api:
        yield Kube(api)


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def chart_crds(kube: Kube, chart: helm.Chart) -> None:
    """The chart's CRDs (InferenceService and kopf peering) installed and Established."""
    install_crds(kube, chart)


LEADER_WORKER_SET_CRD = Path(__file__).parent / "crds" / "leaderworkerset.yaml"
LWS_API = ("leaderworkerset.x-k8s.io/v1", "leaderworkersets")


@pytest.fixture
def leader_worker_set_crd(kube: Kube) -> Iterator[None]:
    """LeaderWorkerSet's API (e2e/crds/leaderworkerset.yaml: its controller cannot be built
    here, so the tests play it), served for one test and removed after."""
    definition = yaml.safe_load(LEADER_WORKER_SET_CRD.read_text())
    path = f"{CRD_PATH}/{definition['metadata']['name']}"
    apply(kube, path, definition, dry_run=False)
    eventually("LeaderWorkerSet served", lambda: True if kube.serves(*LWS_API) else None)
    try:
        yield
    finally:
        kube.request("DELETE", path)
        eventually("LeaderWorkerSet gone", lambda: None if kube.serves(*LWS_API) else True)


GATEWAY_CRDS_BUILD = Path(__file__).parent / "gatewaycrds" / "build.sh"


@pytest.fixture(scope="module")
def gateway_crds(kube: Kube) -> Iterator[None]:
    """The Gateway API's GatewayClass, Gateway and HTTPRoute (v1.6.3, standard channel) and
    the Inference Extension's InferencePool (v1.6.2) as their Go modules ship them (copied by
    e2e/gatewaycrds/build.sh, run here: a no-op download once the modules are cached),
    served for one test module and removed after."""
    if use_existing_cluster():
        pytest.skip("installs and removes cluster-wide CRDs")
    out = Path(__file__).parents[1] / ".cache" / "gatewaycrds"
    subprocess.run([str(GATEWAY_CRDS_BUILD)], check=True, capture_output=True)
    definitions = [yaml.safe_load(path.read_text()) for path in sorted(out.glob("*.yaml"))]
    install_definitions(kube, definitions)
    try:
        yield
    finally:
        for definition in definitions:
            kube.request("DELETE", f"{CRD_PATH}/{definition['metadata']['name']}")
        pools = OPTIONAL_KINDS["InferencePool"]
        eventually("InferencePool gone", lambda: None if kube.serves(*pools) else True)


#: The process nodes' names; tests pin pods to them with the label every process node carries.
PROCESS_NODES = ("process-node-0", "process-node-1")
#: What the process nodes report as their GPUs (the pods run on the CPU all the same): so the
#: scheduler places GPU requests on them as on a GPU cluster.
PROCESS_NODE_GPU = "NVIDIA-L4"


@pytest.fixture(scope="module")
def process_node(
    control_plane: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessNode]:
    """Two nodes that run pods as local processes (e2e/processnode), for one test module,
    each offering 2 `nvidia.com/gpu` (PROCESS_NODE_GPU).

    Tainted, so other tests' pods never land there; pods tolerate the taint to run there. The
    restart back-off starts at 1s (the kubelet's 10s) so crash-loop tests stay short.
    """
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    if use_existing_cluster():
        pytest.skip("the process node joins the test control plane, not an existing cluster")
    with ProcessNode(
        control_plane.kubeconfig,
        tmp_path_factory.mktemp("processnode"),
        PROCESS_NODES,
        gpus=2,
        gpu_product=PROCESS_NODE_GPU,
        backoff_base_s=1.0,
    ) as node:
        yield node
