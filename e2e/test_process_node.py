"""The process node (e2e/processnode) on the real control plane: pods that really run.

Every pod here runs the fleetpilot image, which the node maps to this checkout's environment,
as a process in a network namespace of its own. What is checked is what a kubelet owes the
cluster: Ready pods become EndpointSlice addresses that answer; the image table refuses other
images with an Event; init containers run in order and reach the API server with in-cluster
config; ConfigMap volumes appear at their mountPath for that pod only and follow edits; logs come
back through the API server; crashes restart with growing counts; deleting a pod or stopping
the node leaves no process and no namespace behind.
"""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from kubernetes import client as k8s

from e2e.chart_support import Discovery, apply, release_name, render
from e2e.support import pod_ready
from fleetpilot.kube.client import Kube
from fleetpilot.testing.polling import eventually
from fleetpilot.testing.processnode import (
    FLEETPILOT_IMAGE_PATTERN,
    PROCESS_NODE_LABEL,
    PROCESS_NODE_TOLERATION,
    ProcessNode,
    netns_name,
    network_namespaces,
)

pytestmark = pytest.mark.cluster

IMAGE = FLEETPILOT_IMAGE_PATTERN.replace("*", "e2e")
#: Where the web pods mount their ConfigMap: absent on the host, so only the pod can see it.
CONFIG_DIR = "/etc/fleetpilot-e2e-web"
#: Where they mount one key of their Secret.
SECRET_DIR = "/etc/fleetpilot-e2e-secret"
#: Init containers write here (an emptyDir); the server shows it to the test.
SCRATCH_DIR = "/srv/fleetpilot-e2e"

# The first init container starts the order file; the second appends the API server's version
# read with in-cluster config (KUBERNETES_SERVICE_HOST, the projected token and CA), as the
# operator and router pods do.
INIT_FIRST = f"open('{SCRATCH_DIR}/order.txt', 'w').write('first\\n')"
INIT_API = (
    "from kubernetes import client, config; config.load_incluster_config(); "
    "v = client.VersionApi().get_code().git_version; "
    f"open('{SCRATCH_DIR}/order.txt', 'a').write('api ' + v + '\\n'); print('api', v)"
)
# The server logs its downward-API environment (and $(VAR) expansion in args), then serves /
# as the pod sees it.
SERVER = (
    "import os, runpy, sys; "
    "print('pod', os.environ['POD_IP'], sys.argv[1], os.environ['POD_NAME'], "
    "os.environ['NODE_NAME'], os.environ['FLAVOUR'], os.environ['TOKEN'], flush=True); "
    "sys.argv = ['http.server', '8000', '--directory', '/']; "
    "runpy.run_module('http.server', run_name='__main__')"
)


def on_process_node(spec: dict[str, Any]) -> dict[str, Any]:
    """A pod spec pinned to the process nodes, tolerating their taint."""
    return {
        "nodeSelector": {PROCESS_NODE_LABEL: "true"},
        "tolerations": [PROCESS_NODE_TOLERATION],
        **spec,
    }


def python(name: str, code: str, *args: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": IMAGE, "command": ["python", "-c", code, *args], **extra}


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def pids_running(marker: str) -> list[int]:
    """Pids whose command line holds `marker` (a token unique to one test)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def pod(core: k8s.CoreV1Api, namespace: str, name: str) -> k8s.V1Pod:
    return core.read_namespaced_pod(name, namespace)


def test_deployment_serves_from_pod_ips(
    process_node: ProcessNode, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """A 2-replica Deployment of the fleetpilot image turns Available through its readiness
    probes; its EndpointSlice lists both pod IPs, each of which answers the test on the same
    port. Init containers ran in order and reached the API server with in-cluster config;
    downward-API, ConfigMap and Secret env and $(VAR) args arrived; the ConfigMap and Secret
    volumes are the pod's own and follow an edit; pods/log serves, also with follow. Also
    protects the mount order: an emptyDir at /tmp once hid the other volumes' sources."""
    core, apps = k8s.CoreV1Api(k8s_api), k8s.AppsV1Api(k8s_api)
    config = {"greeting.txt": "hello v1\n", "flavour": "plain"}
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "web"}, "data": config})
    secret = {"token": "s3cret", "other": "x"}
    core.create_namespaced_secret(namespace, {"metadata": {"name": "web"}, "stringData": secret})
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "FLAVOUR", "valueFrom": {"configMapKeyRef": {"name": "web", "key": "flavour"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "web", "key": "token"}}},
    ]
    scratch = {"name": "scratch", "mountPath": SCRATCH_DIR}
    server = python(
        "web",
        SERVER,
        "$(POD_IP)",
        env=env,
        ports=[{"name": "http", "containerPort": 8000}],
        readinessProbe={
            "httpGet": {"path": f"{CONFIG_DIR}/greeting.txt", "port": "http"},
            "periodSeconds": 1,
        },
        volumeMounts=[
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "secret", "mountPath": SECRET_DIR, "readOnly": True},
            scratch,
            # As the operator's own pod does. The node's volume folders are under /tmp here
            # (pytest's tmp_path): mounting this one first must not hide the others.
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    )
    spec = on_process_node(
        {
            "initContainers": [
                python("first", INIT_FIRST, volumeMounts=[scratch]),
                python("api", INIT_API, volumeMounts=[scratch]),
            ],
            "containers": [server],
            "volumes": [
                {"name": "config", "configMap": {"name": "web"}},
                {
                    "name": "secret",
                    "secret": {"secretName": "web", "items": [{"key": "token", "path": "t"}]},
                },
                {"name": "scratch", "emptyDir": {}},
                {"name": "tmp", "emptyDir": {}},
            ],
            "terminationGracePeriodSeconds": 5,
        }
    )
    labels = {"app": "web"}
    apps.create_namespaced_deployment(namespace, {
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": spec},
        },
    })  # fmt: skip
    core.create_namespaced_service(namespace, {
        "metadata": {"name": "web"},
        "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8000}]},
    })  # fmt: skip

    def available() -> bool | None:
        status = apps.read_namespaced_deployment_status("web", namespace).status
        return True if status.available_replicas == 2 else None

    eventually("the Deployment Available with 2 ready pods", available, timeout=60)
    pods = core.list_namespaced_pod(namespace, label_selector="app=web").items
    ips = {p.status.pod_ip for p in pods}
    assert len(ips) == 2
    assert all(ip.startswith("10.244.") for ip in ips)
    assert {p.spec.node_name for p in pods} <= set(process_node.names)

    discovery = k8s.DiscoveryV1Api(k8s_api)

    def endpoint_ips() -> set[str] | None:
        slices = discovery.list_namespaced_endpoint_slice(
            namespace, label_selector="kubernetes.io/service-name=web"
        ).items
        found = {
            address
            for s in slices
            for e in s.endpoints or []
            if e.conditions.ready
            for address in e.addresses
        }
        return found if found == ips else None

    eventually("the EndpointSlice listing both pod IPs", endpoint_ips)
    for p in pods:
        ip = p.status.pod_ip
        # Both pods bind 0.0.0.0:8000: their own namespaces keep the ports apart.
        assert get(f"http://{ip}:8000{CONFIG_DIR}/greeting.txt") == "hello v1\n"
        order = get(f"http://{ip}:8000{SCRATCH_DIR}/order.txt").splitlines()
        assert order[0] == "first"
        assert order[1].startswith("api v1.37"), order
        log = core.read_namespaced_pod_log(p.metadata.name, namespace, container="web")
        assert f"pod {ip} {ip} {p.metadata.name} {p.spec.node_name} plain s3cret" in log
        assert get(f"http://{ip}:8000{SECRET_DIR}/t") == "s3cret"
        with pytest.raises(urllib.error.HTTPError):
            get(f"http://{ip}:8000{SECRET_DIR}/other")  # not among the volume's items
        assert [(s.name, s.ready) for s in p.status.init_container_statuses] == [
            ("first", True),
            ("api", True),
        ]
        api_log = core.read_namespaced_pod_log(p.metadata.name, namespace, container="api")
        assert api_log.startswith("api v1.37")
    # `kubectl logs -f`: the stream shows a request made after it opened.
    first = pods[0]
    stream = core.read_namespaced_pod_log(
        first.metadata.name, namespace, container="web", follow=True,
        _preload_content=False, _request_timeout=15,
    )  # fmt: skip
    marker = uuid.uuid4().hex
    with pytest.raises(urllib.error.HTTPError):
        get(f"http://{first.status.pod_ip}:8000/{marker}")
    seen = b""
    for chunk in stream.stream(1024):
        seen += chunk
        if marker.encode() in seen:
            break
    stream.release_conn()
    assert marker.encode() in seen
    # The mount is the pod's own: nothing of it on the host.
    assert not Path(CONFIG_DIR, "greeting.txt").exists()

    core.patch_namespaced_config_map("web", namespace, {"data": {"greeting.txt": "hello v2\n"}})
    for ip in ips:
        url = f"http://{ip}:8000{CONFIG_DIR}/greeting.txt"
        eventually(
            f"{ip} serving the edited ConfigMap",
            lambda url=url: True if get(url) == "hello v2\n" else None,  # type: ignore[misc]
            timeout=20,
        )


def test_nodes_register_with_their_resources(
    process_node: ProcessNode, k8s_api: k8s.ApiClient
) -> None:
    """Each node registers with its allocatable CPU and GPUs, the GPU product label, Ready,
    and a Lease that virtual-kubelet renews."""
    core = k8s.CoreV1Api(k8s_api)
    for name in process_node.names:
        node = core.read_node(name)
        assert node.metadata.labels[PROCESS_NODE_LABEL] == "true"
        assert node.metadata.labels["nvidia.com/gpu.product"] == process_node.gpu_product
        assert node.status.allocatable["nvidia.com/gpu"] == str(process_node.gpus)
        assert node.status.allocatable["cpu"] == "8"
        ready = next(c for c in node.status.conditions if c.type == "Ready")
        assert ready.status == "True"
        # virtual-kubelet renews the node's Lease, as a kubelet does.
        lease = k8s.CoordinationV1Api(k8s_api).read_namespaced_lease(name, "kube-node-lease")
        assert lease.spec.holder_identity == name


def test_the_charts_operator_runs_ready_on_a_process_node(
    process_node: ProcessNode,
    k8s_api: k8s.ApiClient,
    kube: Kube,
    chart: helm.Chart,
    chart_crds: None,
    namespace: str,
) -> None:
    """The chart installed as `helm install` would, its operator pinned to the process nodes:
    the hardest pod here (restricted securityContext, /tmp as an emptyDir, the projected
    ServiceAccount token, probes on a named port) runs, turns Ready and wins its Lease through
    in-cluster config."""
    values = {
        "watchNamespaces": [namespace],
        "nodeSelector": {PROCESS_NODE_LABEL: "true"},
        "tolerations": [PROCESS_NODE_TOLERATION],
    }
    release = release_name()
    objects = [
        o
        for o in render(chart, values, release, namespace)
        if "helm.sh/hook" not in o["metadata"].get("annotations", {})
    ]
    discovery = Discovery(kube)
    cluster_scoped = []
    try:
        for obj in objects:
            path = discovery.path(obj)
            if path is None:
                continue  # PodMonitor and the like: no such API here
            apply(kube, path, obj, dry_run=False)
            if "namespace" not in obj["metadata"]:
                cluster_scoped.append(path)
        apps, core = k8s.AppsV1Api(k8s_api), k8s.CoreV1Api(k8s_api)
        name = next(o for o in objects if o["kind"] == "Deployment")["metadata"]["name"]

        def available() -> bool | None:
            status = apps.read_namespaced_deployment_status(name, namespace).status
            return True if status.available_replicas == 1 else None

        eventually("the operator Deployment Available", available, timeout=90)
        selector = "app.kubernetes.io/component=operator"
        pods = core.list_namespaced_pod(namespace, label_selector=selector).items
        assert len(pods) == 1
        operator = pods[0]
        assert operator.spec.node_name in process_node.names
        lease = k8s.CoordinationV1Api(k8s_api).read_namespaced_lease(name, namespace)
        assert lease.spec.holder_identity.startswith(operator.metadata.name)
    finally:
        for path in cluster_scoped:
            kube.request("DELETE", path)


def test_unknown_image_is_refused_with_an_event(
    process_node: ProcessNode, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """An image outside the table is refused as a kubelet refuses one it cannot pull: the
    container waits with ErrImagePull and an Event names the image."""
    core = k8s.CoreV1Api(k8s_api)
    image = "docker.io/library/nginx:1.27"
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "nginx"},
        "spec": on_process_node({"containers": [{"name": "nginx", "image": image}]}),
    })  # fmt: skip

    def refused() -> k8s.CoreV1Event | None:
        events = core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=nginx"
        ).items
        return next((e for e in events if e.type == "Warning" and image in e.message), None)

    event = eventually("an Event naming the refused image", refused)
    assert event.reason == "Failed"

    def image_pull_error() -> bool | None:
        # The Event and the status travel separately: either may arrive first.
        statuses = pod(core, namespace, "nginx").status.container_statuses or []
        waiting = statuses[0].state.waiting if statuses else None
        return True if waiting and waiting.reason == "ErrImagePull" else None

    eventually("the container waiting with ErrImagePull", image_pull_error)
    assert pod(core, namespace, "nginx").status.phase == "Pending"


def test_pod_waits_for_a_config_map_made_after_it(
    process_node: ProcessNode, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """A pod whose ConfigMap does not exist yet waits (a FailedMount Event) and runs once it
    does; it once stayed Pending for good."""
    core = k8s.CoreV1Api(k8s_api)
    mount = {"name": "late", "mountPath": CONFIG_DIR}
    code = f"print(open('{CONFIG_DIR}/value').read(), flush=True)"
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "patient"},
        "spec": on_process_node({
            "restartPolicy": "Never",
            "containers": [python("patient", code, volumeMounts=[mount])],
            "volumes": [{"name": "late", "configMap": {"name": "late"}}],
        }),
    })  # fmt: skip

    def failed_mount() -> bool | None:
        events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=patient")
        return True if any(e.reason == "FailedMount" for e in events.items) else None

    eventually("a FailedMount Event", failed_mount)
    assert pod(core, namespace, "patient").status.phase == "Pending"
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "late"}, "data": {"value": "arrived"}}
    )

    def succeeded() -> bool | None:
        return True if pod(core, namespace, "patient").status.phase == "Succeeded" else None

    eventually("the pod run once its ConfigMap exists", succeeded, timeout=30)
    assert core.read_namespaced_pod_log("patient", namespace) == "arrived\n"


def test_crashing_container_restarts_with_back_off(
    process_node: ProcessNode, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """A container that exits 3 under restartPolicy Always restarts with a growing count; the
    last termination and the previous run's log are reported."""
    core = k8s.CoreV1Api(k8s_api)
    code = "import sys; print('crashing', flush=True); sys.exit(3)"
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "crash"},
        "spec": on_process_node({"containers": [python("crash", code)]}),
    })  # fmt: skip

    def restarted_twice() -> k8s.V1ContainerStatus | None:
        statuses = pod(core, namespace, "crash").status.container_statuses or []
        return statuses[0] if statuses and statuses[0].restart_count >= 2 else None

    status = eventually("two restarts", restarted_twice, timeout=30)
    assert status.last_state.terminated.exit_code == 3
    assert status.last_state.terminated.reason == "Error"
    assert pod(core, namespace, "crash").status.phase == "Running"
    previous = core.read_namespaced_pod_log("crash", namespace, previous=True)
    assert previous == "crashing\n"


# Serves / as the pod sees it, with a file that says it is alive for 6 seconds per run.
FLAKY_SERVER = (
    "import os, runpy, sys, threading, time; "
    f"open('{SCRATCH_DIR}/alive', 'w').write('ok'); "
    f"threading.Timer(6, os.remove, ['{SCRATCH_DIR}/alive']).start(); "
    "sys.argv = ['http.server', '8000', '--directory', '/']; "
    "runpy.run_module('http.server', run_name='__main__')"
)


def test_probes_drive_ready_and_restarts(
    process_node: ProcessNode, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """Startup (TCP), readiness (a command in the pod, which must see the pod's own mounts) and
    liveness (HTTP) probes: the pod turns Ready, a failing liveness probe restarts it (SIGTERM:
    exit 143), and it turns Ready again, with the kubelet's Unhealthy and Killing Events."""
    core = k8s.CoreV1Api(k8s_api)
    alive = f"{SCRATCH_DIR}/alive"
    container = python(
        "flaky",
        FLAKY_SERVER,
        volumeMounts=[{"name": "scratch", "mountPath": SCRATCH_DIR}],
        # A startup probe over TCP; readiness runs a command in the pod (it sees the pod's
        # own mounts); liveness asks over HTTP.
        startupProbe={"tcpSocket": {"port": 8000}, "periodSeconds": 1, "failureThreshold": 30},
        readinessProbe={"exec": {"command": ["test", "-f", alive]}, "periodSeconds": 1},
        livenessProbe={"httpGet": {"path": alive, "port": 8000}, "periodSeconds": 1},
    )
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "flaky"},
        "spec": on_process_node({
            "containers": [container],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "terminationGracePeriodSeconds": 2,
        }),
    })  # fmt: skip

    def restarted_and_ready() -> k8s.V1ContainerStatus | None:
        p = pod(core, namespace, "flaky")
        statuses = p.status.container_statuses or []
        if statuses and statuses[0].restart_count >= 1 and pod_ready(p):
            return statuses[0]
        return None

    status = eventually("a liveness restart, then Ready again", restarted_and_ready, timeout=40)
    # SIGTERM ended the server: 128 + 15.
    assert status.last_state.terminated.exit_code == 143
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=flaky")
    messages = {(e.reason, e.message.split(":")[0]) for e in events.items}
    assert ("Unhealthy", "Liveness probe failed") in messages
    assert ("Unhealthy", "Readiness probe failed") in messages
    assert any(reason == "Killing" for reason, _ in messages)


def test_claim_bound_to_a_host_path_volume_is_mounted(
    process_node: ProcessNode, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """A PVC pre-bound to a hostPath PersistentVolume is mounted; what the pod writes lands in
    the volume's directory; a finished pod's mount point is gone at once, its log kept."""
    core = k8s.CoreV1Api(k8s_api)
    directory = process_node.bind_claim(k8s_api, namespace, "data")
    mount_path = "/var/lib/fleetpilot-e2e-data"
    # HOME is the pod's own (not the agent's): what lands there goes with the pod.
    code = (
        f"import os; open('{mount_path}/hello.txt', 'w').write('from the pod'); "
        "open(os.path.expanduser('~/note'), 'w').write('x'); print(os.environ['HOME'])"
    )
    # It asks for a GPU too: the scheduler places it by the nodes' nvidia.com/gpu.
    writer = python(
        "writer",
        code,
        volumeMounts=[{"name": "data", "mountPath": mount_path}],
        resources={"limits": {"nvidia.com/gpu": "1"}},
    )
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "writer"},
        "spec": on_process_node({
            "restartPolicy": "Never",
            "containers": [writer],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        }),
    })  # fmt: skip

    def finished() -> str | None:
        phase = pod(core, namespace, "writer").status.phase
        return phase if phase in ("Succeeded", "Failed") else None

    assert eventually("the writer pod finished", finished) == "Succeeded"
    assert (directory / "hello.txt").read_text() == "from the pod"
    # A finished pod's volumes are unmounted and its mount point gone, as with a kubelet;
    # its logs stay until it is deleted.
    eventually("the mount point removed", lambda: None if Path(mount_path).exists() else True)
    home = Path(core.read_namespaced_pod_log("writer", namespace).strip())
    assert home.is_relative_to(process_node.workdir)
    assert netns_name(pod(core, namespace, "writer").status.pod_ip) not in network_namespaces()

    # A volume reserved for a claim made later by someone else (as the operator makes its
    # model cache's claim, with no storage class): the two are bound when the claim appears.
    process_node.bind_claim(k8s_api, namespace, "later", create_claim=False)
    core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": "later"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    })  # fmt: skip

    def bound() -> str | None:
        claim = core.read_namespaced_persistent_volume_claim("later", namespace)
        return claim.spec.volume_name if claim.status.phase == "Bound" else None

    assert eventually("the later claim bound", bound) == f"{namespace}-later"


def test_pod_delete_leaves_no_process_or_namespace(
    process_node: ProcessNode, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """Deleting a pod whose process ignores SIGTERM and leaves a child: SIGKILL after the
    grace period ends the whole process group, and the network namespace goes."""
    core = k8s.CoreV1Api(k8s_api)
    marker = f"e2e-{uuid.uuid4().hex}"
    # Ignores SIGTERM and leaves a child behind: only SIGKILL after the grace period, for
    # the whole process group, ends it.
    code = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]]); "
        "time.sleep(600)"
    )
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "stubborn"},
        "spec": on_process_node({
            "containers": [python("stubborn", code, marker)],
            "terminationGracePeriodSeconds": 2,
        }),
    })  # fmt: skip
    eventually(
        "the pod and its child running", lambda: True if len(pids_running(marker)) == 2 else None
    )
    # The processes run before the status saying so reaches the API server.
    ip = eventually("the pod's IP", lambda: pod(core, namespace, "stubborn").status.pod_ip)
    assert netns_name(ip) in network_namespaces()

    core.delete_namespaced_pod("stubborn", namespace)

    def gone() -> bool | None:
        try:
            pod(core, namespace, "stubborn")
        except k8s.ApiException as e:
            return True if e.status == 404 else None
        return None

    eventually("the pod deleted once its processes stopped", gone, timeout=30)
    eventually("no process left", lambda: True if not pids_running(marker) else None, timeout=10)
    # virtual-kubelet removes the pod object when the grace period ends, as the SIGKILL
    # goes out: the namespace goes a moment after (a kubelet would delete the object last).
    eventually(
        "the namespace removed", lambda: None if netns_name(ip) in network_namespaces() else True
    )


def test_node_stop_leaves_no_process_or_namespace(
    process_node: ProcessNode, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """Stopping the agent stops every pod (they end Failed, reason Terminated) and leaves no
    process and no namespace. Last in this module: it stops the module's node (the fixture's
    stop is then a no-op)."""
    core = k8s.CoreV1Api(k8s_api)
    marker = f"e2e-{uuid.uuid4().hex}"
    code = "import sys, time; time.sleep(600)"
    for name in ("sleeper-0", "sleeper-1"):
        core.create_namespaced_pod(namespace, {
            "metadata": {"name": name},
            "spec": on_process_node({
                "containers": [python("sleep", code, marker)],
                "terminationGracePeriodSeconds": 2,
            }),
        })  # fmt: skip
    eventually("both pods running", lambda: True if len(pids_running(marker)) == 2 else None)
    for name in ("sleeper-0", "sleeper-1"):
        eventually(
            f"{name} Running",
            lambda n=name: pod(core, namespace, n).status.phase == "Running" or None,
        )  # type: ignore[misc]
    assert network_namespaces()

    process_node.stop()

    for name in ("sleeper-0", "sleeper-1"):
        status = pod(core, namespace, name).status
        assert (status.phase, status.reason) == ("Failed", "Terminated")
    assert not process_node.alive()
    assert pids_running(marker) == []
    assert network_namespaces() == set()
    assert not (process_node.workdir / "state" / "pods").exists() or not any(
        (process_node.workdir / "state" / "pods").iterdir()
    )
