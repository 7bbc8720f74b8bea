"""The test control plane behaves like a real cluster where fleetpilot depends on it.

Each test proves one thing the operator relies on: CRDs with CEL validation, server-side apply
field ownership, the controller-manager and scheduler placing GPU pods by product and count,
garbage collection through ownerReferences, RBAC for a ServiceAccount, and that teardown
leaves no process behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client as k8s

from fleetpilot.runtime.processes import group_members
from fleetpilot.testing.cluster import Cluster
from fleetpilot.testing.controlplane import STATE_FILE
from fleetpilot.testing.nodes import GPU_PRODUCT_LABEL, GPU_RESOURCE
from fleetpilot.testing.polling import eventually

pytestmark = pytest.mark.cluster

H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"
H100_NODE = "e2e-h100-0"
A100_NODE = "e2e-a100-0"

T = TypeVar("T")


@pytest.fixture(scope="session")
def gpu_nodes(control_plane: Cluster) -> dict[str, str]:
    """Two fake 8-GPU nodes with different products; only on a cluster we started."""
    if not control_plane.fake_nodes:
        pytest.skip("needs fake GPU nodes, which are only added to a cluster the tests started")
    control_plane.add_gpu_node(H100_NODE, H100, gpus=8)
    control_plane.add_gpu_node(A100_NODE, A100, gpus=8)
    return {H100: H100_NODE, A100: A100_NODE}


# --------------------------------------------------------------------------- API server


def _get(api: k8s.ApiClient, path: str) -> tuple[int, bytes]:
    """GET a path that has no generated method, through the client so its auth applies."""
    request = api.param_serialize("GET", path, auth_settings=["BearerToken"])
    response = api.call_api(*request)
    return int(response.status), bytes(response.read())  # type: ignore[no-untyped-call]


def test_api_server_is_ready(control_plane: Cluster, k8s_api: k8s.ApiClient) -> None:
    """The API server answers over TLS with a 1.x version (ours stamped by build.sh) and passes
    every /readyz check: the ground every other test stands on."""
    version = k8s.VersionApi(k8s_api).get_code()
    assert version.major == "1"
    assert control_plane.server.startswith("https://")
    if control_plane.fake_nodes:  # our own build: the version is stamped by build.sh
        assert version.git_version.startswith("v1.")
    status, body = _get(k8s_api, "/readyz?verbose")
    assert status == 200
    assert b"readyz check passed" in body


def test_openapi_is_served(k8s_api: k8s.ApiClient) -> None:
    """kubectl apply/explain need OpenAPI; a toolchain mismatch once broke exactly this."""
    status, body = _get(k8s_api, "/openapi/v3")
    assert status == 200
    assert "apis/apps/v1" in json.loads(body)["paths"]
    status, body = _get(k8s_api, "/openapi/v3/apis/apps/v1")
    assert status == 200
    assert "io.k8s.api.apps.v1.Deployment" in json.loads(body)["components"]["schemas"]
    status, body = _get(k8s_api, "/openapi/v2")
    assert status == 200
    assert "io.k8s.api.apps.v1.Deployment" in json.loads(body)["definitions"]


def test_fake_gpu_nodes_are_ready_and_untainted(
    gpu_nodes: dict[str, str], k8s_api: k8s.ApiClient
) -> None:
    """The fake nodes are Ready, untainted, labelled with their GPU product and offer 8 GPUs: what
    the scheduler needs to place engine pods on them."""
    core = k8s.CoreV1Api(k8s_api)
    for product, name in gpu_nodes.items():
        node = core.read_node(name)
        assert node.metadata is not None
        assert node.metadata.labels is not None
        assert node.metadata.labels[GPU_PRODUCT_LABEL] == product
        assert node.status is not None
        assert node.status.allocatable is not None
        assert node.status.allocatable[GPU_RESOURCE] == "8"
        assert node.spec is not None
        assert not node.spec.taints
        ready = [c for c in node.status.conditions or [] if c.type == "Ready"]
        assert [c.status for c in ready] == ["True"]


# --------------------------------------------------------------------------- CRD + CEL

CRD_GROUP = "e2e.fleetpilot.dev"
CEL_MESSAGE = "minReplicas must not exceed maxReplicas"


@pytest.fixture
def widget_crd(k8s_api: k8s.ApiClient) -> Iterator[str]:
    """A tiny namespaced CRD whose spec carries a CEL rule; yields its plural."""
    suffix = uuid.uuid4().hex[:6]
    plural = f"widgets{suffix}"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{CRD_GROUP}"},
        "spec": {
            "group": CRD_GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": f"widget{suffix}", "kind": f"Widget{suffix}"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "minReplicas": {"type": "integer"},
                                        "maxReplicas": {"type": "integer"},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.minReplicas <= self.maxReplicas",
                                            "message": CEL_MESSAGE,
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    ext = k8s.ApiextensionsV1Api(k8s_api)
    body = k8s.V1CustomResourceDefinition.from_dict(crd)
    assert body is not None
    ext.create_custom_resource_definition(body)
    name = f"{plural}.{CRD_GROUP}"

    def established() -> bool | None:
        got = ext.read_custom_resource_definition(name)
        conditions = got.status.conditions if got.status else None
        ok = any(c.type == "Established" and c.status == "True" for c in conditions or [])
        return True if ok else None

    eventually(f"CRD {name} Established", established)
    yield plural
    ext.delete_custom_resource_definition(name)


def test_crd_with_cel_rule_is_established_and_enforced(
    widget_crd: str, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """A CRD's CEL rule is enforced by the API server: an object breaking it is refused with 422 and
    the rule's message, as the InferenceService CRD's validation relies on."""
    objects = k8s.CustomObjectsApi(k8s_api)
    kind = "Widget" + widget_crd.removeprefix("widgets")

    def widget(name: str, low: int, high: int) -> dict[str, Any]:
        return {
            "apiVersion": f"{CRD_GROUP}/v1",
            "kind": kind,
            "metadata": {"name": name},
            "spec": {"minReplicas": low, "maxReplicas": high},
        }

    # A just-Established CRD can take a moment to be served by every handler chain.
    def create_good() -> bool | None:
        try:
            objects.create_namespaced_custom_object(
                CRD_GROUP, "v1", namespace, widget_crd, widget("good", 1, 3)
            )
        except k8s.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return True

    eventually("custom object accepted", create_good, timeout=30)

    with pytest.raises(k8s.ApiException) as refused:
        objects.create_namespaced_custom_object(
            CRD_GROUP, "v1", namespace, widget_crd, widget("bad", 5, 2)
        )
    assert refused.value.status == 422
    assert CEL_MESSAGE in str(refused.value.body)


# --------------------------------------------------------------------------- server-side apply


def _apply_config_map(
    core: k8s.CoreV1Api, namespace: str, manager: str, data: dict[str, str], *, force: bool = False
) -> k8s.V1ConfigMap:
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "shared", "namespace": namespace},
        "data": data,
    }
    return core.patch_namespaced_config_map(
        "shared",
        namespace,
        body,
        field_manager=manager,
        force=force or None,
        _content_type="application/apply-patch+yaml",
    )


def test_server_side_apply_keeps_each_managers_fields(
    k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """Server-side apply keeps each manager's fields: the operator's re-apply leaves the
    autoscaler's field alone, and taking another's field is a 409 unless forced."""
    core = k8s.CoreV1Api(k8s_api)
    _apply_config_map(core, namespace, "operator", {"replicas": "2"})
    _apply_config_map(core, namespace, "autoscaler", {"target": "7"})
    # The operator re-applies its intent: the autoscaler's field must survive.
    merged = _apply_config_map(core, namespace, "operator", {"replicas": "3"})
    assert merged.data == {"replicas": "3", "target": "7"}
    managers = {entry.manager for entry in merged.metadata.managed_fields or []}  # type: ignore[union-attr]
    assert {"operator", "autoscaler"} <= managers

    # Taking another manager's field needs force: without it the server reports a conflict.
    with pytest.raises(k8s.ApiException) as conflict:
        _apply_config_map(core, namespace, "autoscaler", {"target": "7", "replicas": "9"})
    assert conflict.value.status == 409
    taken = _apply_config_map(
        core, namespace, "autoscaler", {"target": "7", "replicas": "9"}, force=True
    )
    assert taken.data == {"replicas": "9", "target": "7"}


# --------------------------------------------------------------------------- scheduling


def _gpu_deployment(name: str, product: str, gpus: int, replicas: int) -> k8s.V1Deployment:
    labels = {"app": name}
    return k8s.V1Deployment(
        metadata=k8s.V1ObjectMeta(name=name),
        spec=k8s.V1DeploymentSpec(
            replicas=replicas,
            selector=k8s.V1LabelSelector(match_labels=labels),
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=labels),
                spec=k8s.V1PodSpec(
                    node_selector={GPU_PRODUCT_LABEL: product},
                    containers=[
                        k8s.V1Container(
                            name="engine",
                            # Never pulled: there is no kubelet.
                            image="registry.invalid/fleetpilot/engine:test",
                            resources=k8s.V1ResourceRequirements(limits={GPU_RESOURCE: str(gpus)}),
                        )
                    ],
                ),
            ),
        ),
    )


def _pods(core: k8s.CoreV1Api, namespace: str, app: str) -> list[k8s.V1Pod]:
    return list(core.list_namespaced_pod(namespace, label_selector=f"app={app}").items)


def _unschedulable(pod: k8s.V1Pod) -> bool:
    conditions = pod.status.conditions if pod.status else None
    return any(
        c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
        for c in conditions or []
    )


def test_gpu_pods_land_on_matching_node_or_stay_pending(
    gpu_nodes: dict[str, str], k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """GPU pods are placed by product and count: they land on a node of the wanted product, and a
    pod wanting too many GPUs or an absent product stays Pending, Unschedulable."""
    apps = k8s.AppsV1Api(k8s_api)
    core = k8s.CoreV1Api(k8s_api)
    apps.create_namespaced_deployment(namespace, _gpu_deployment("fits", H100, 2, replicas=2))
    apps.create_namespaced_deployment(namespace, _gpu_deployment("too-big", H100, 16, 1))
    apps.create_namespaced_deployment(
        namespace, _gpu_deployment("no-such-gpu", "NVIDIA-B200", 1, 1)
    )

    # The deployment and replicaset controllers create the pods; the scheduler binds them.
    def placed() -> list[str] | None:
        pods = _pods(core, namespace, "fits")
        nodes = [p.spec.node_name for p in pods if p.spec and p.spec.node_name]
        return nodes if len(pods) == 2 and len(nodes) == 2 else None

    # Other tests in the session may register more H100 nodes: check the product, not the name.
    for node_name in eventually("2 'fits' pods bound", placed):
        node = core.read_node(node_name)
        assert node.metadata is not None
        assert node.metadata.labels is not None
        assert node.metadata.labels[GPU_PRODUCT_LABEL] == H100
        assert node_name != gpu_nodes[A100]

    for app in ("too-big", "no-such-gpu"):

        def pending(app: str = app) -> k8s.V1Pod | None:
            pods = _pods(core, namespace, app)
            return pods[0] if len(pods) == 1 and _unschedulable(pods[0]) else None

        pod = eventually(f"'{app}' pod reported Unschedulable", pending)
        assert pod.spec is not None
        assert pod.spec.node_name is None
        assert pod.status is not None
        assert pod.status.phase == "Pending"


# --------------------------------------------------------------------------- garbage collection


def test_owner_deletion_garbage_collects_children(k8s_api: k8s.ApiClient, namespace: str) -> None:
    """Deleting an owner garbage-collects what names it in ownerReferences: how a deleted
    InferenceService takes its children with it."""
    core = k8s.CoreV1Api(k8s_api)
    owner = core.create_namespaced_config_map(
        namespace, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="owner"))
    )
    assert owner.metadata is not None
    assert owner.metadata.uid
    reference = k8s.V1OwnerReference(
        api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid
    )
    core.create_namespaced_config_map(
        namespace,
        k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="child", owner_references=[reference])),
    )
    assert core.read_namespaced_config_map("child", namespace).metadata is not None
    core.delete_namespaced_config_map("owner", namespace)

    def child_gone() -> bool | None:
        try:
            core.read_namespaced_config_map("child", namespace)
        except k8s.ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return None

    eventually("child ConfigMap garbage-collected", child_gone)


# --------------------------------------------------------------------------- RBAC


def test_service_account_is_limited_by_rbac(
    control_plane: Cluster, k8s_api: k8s.ApiClient, namespace: str, tmp_path: Path
) -> None:
    """RBAC is enforced for a ServiceAccount: refused (403) until a RoleBinding grants it, then
    allowed only what the Role lists."""
    kubeconfig = control_plane.service_account_kubeconfig(
        namespace, "reader", tmp_path / "reader.kubeconfig"
    )
    reader = Cluster(kubeconfig)
    with reader.api_client() as api:
        core = k8s.CoreV1Api(api)
        with pytest.raises(k8s.ApiException) as denied:
            core.list_namespaced_config_map(namespace)
        assert denied.value.status == 403

        rbac = k8s.RbacAuthorizationV1Api(k8s_api)
        rbac.create_namespaced_role(
            namespace,
            k8s.V1Role(
                metadata=k8s.V1ObjectMeta(name="read-config-maps"),
                rules=[k8s.V1PolicyRule(api_groups=[""], resources=["configmaps"], verbs=["list"])],
            ),
        )
        rbac.create_namespaced_role_binding(
            namespace,
            k8s.V1RoleBinding(
                metadata=k8s.V1ObjectMeta(name="reader"),
                role_ref=k8s.V1RoleRef(
                    api_group="rbac.authorization.k8s.io", kind="Role", name="read-config-maps"
                ),
                subjects=[
                    k8s.RbacV1Subject(kind="ServiceAccount", name="reader", namespace=namespace)
                ],
            ),
        )

        def allowed() -> bool | None:
            try:
                core.list_namespaced_config_map(namespace)
            except k8s.ApiException as exc:
                if exc.status == 403:  # the RBAC authorizer's cache catches up within moments
                    return None
                raise
            return True

        eventually("ServiceAccount allowed after RoleBinding", allowed, timeout=30)
        with pytest.raises(k8s.ApiException) as still_denied:
            core.list_namespaced_secret(namespace)
        assert still_denied.value.status == 403


# --------------------------------------------------------------------------- teardown


def test_cli_up_and_down_leave_no_process(control_plane: Cluster, tmp_path: Path) -> None:
    """`up` detaches a second, independent cluster; `down` stops it by pid, leaving nothing."""
    if not control_plane.fake_nodes:
        pytest.skip("starts a local control plane; not with FLEETPILOT_E2E_CLUSTER")
    workdir = tmp_path / "cluster"
    cli = [sys.executable, "-m", "fleetpilot.testing.cli"]
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    up = subprocess.run(
        [*cli, "up", "--dir", str(workdir), "--no-build"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    kubeconfig = Path(up.stdout.strip())
    assert kubeconfig.is_file()
    state = json.loads((workdir / STATE_FILE).read_text())
    pids = {int(p["pid"]) for p in state["processes"]}
    assert len(pids) == 4
    try:
        # The detached cluster works on its own: it serves its default fake nodes.
        with Cluster(kubeconfig).api_client() as api:
            nodes = k8s.CoreV1Api(api).list_node().items
        assert len(nodes) == 2
        assert group_members(pids)  # sanity: we can see its processes
    finally:
        down = subprocess.run(
            [*cli, "down", "--dir", str(workdir)],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
    assert down.returncode == 0, down.stderr
    assert group_members(pids) == []
    assert not (workdir / STATE_FILE).exists()
    # A second `down` is a harmless no-op.
    again = subprocess.run(
        [*cli, "down", "--dir", str(workdir)], capture_output=True, text=True, env=env, check=False
    )
    assert again.returncode == 0
