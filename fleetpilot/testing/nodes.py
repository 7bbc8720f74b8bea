"""Fake GPU nodes: Node objects that look to the scheduler like NVIDIA GPU machines.

The test control plane has no kubelet, so nothing would ever register a node or report it
Ready. These are registered and marked Ready here, once: with the node-lifecycle controller off
(see `controlplane.CONTROLLERS`) no missing heartbeat ever marks them NotReady.
"""

from __future__ import annotations

import datetime as dt
import logging

from kubernetes import client as k8s

log = logging.getLogger(__name__)

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
#: Label on every node registered here, so tests and humans can tell fakes from real nodes.
FAKE_NODE_LABEL = "fleetpilot.dev/fake-node"


def register_gpu_node(
    api: k8s.ApiClient,
    name: str,
    product: str,
    gpus: int = 8,
    *,
    cpu: str = "96",
    memory: str = "1Ti",
    pods: int = 110,
) -> None:
    """Register Node `name` with `gpus` x `product` GPUs, Ready and untainted.

    Capacity and allocatable carry `nvidia.com/gpu` as the NVIDIA device plugin reports it,
    and the `nvidia.com/gpu.product` label as GPU feature discovery sets it, so the real
    scheduler places GPU pods exactly as it would on a GPU cluster. Status is written
    through the status subresource, as a kubelet does.
    """
    resources = {"cpu": cpu, "memory": memory, "pods": str(pods), GPU_RESOURCE: str(gpus)}
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        GPU_PRODUCT_LABEL: product,
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.present": "true",
        FAKE_NODE_LABEL: "true",
    }
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def condition(kind: str, status: str, reason: str) -> dict[str, str]:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": "set by fleetpilot.testing (no kubelet)",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }

    status = {
        "capacity": resources,
        "allocatable": resources,
        "conditions": [
            condition("Ready", "True", "KubeletReady"),
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID"),
        ],
        "addresses": [{"type": "Hostname", "address": name}],
        "nodeInfo": {
            "architecture": "amd64",
            "operatingSystem": "linux",
            "osImage": "fleetpilot fake node",
            "kernelVersion": "0.0.0",
            "containerRuntimeVersion": "fake://0.0.0",
            "kubeletVersion": "v0.0.0-fake",
            "kubeProxyVersion": "",
            "machineID": name,
            "systemUUID": name,
            "bootID": name,
        },
    }
    core = k8s.CoreV1Api(api)
    core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=name, labels=labels)))
    core.patch_node_status(name, {"status": status}, _content_type="application/merge-patch+json")
    log.info("registered fake node %s: %d x %s", name, gpus, product)
