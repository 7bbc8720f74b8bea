"""Nodes that run pods as local processes: the agent in e2e/processnode, started and stopped.

The test control plane has no kubelet. `ProcessNode` starts the agent (a virtual-kubelet
provider, built by `e2e/processnode/build.sh`) against a running cluster: it registers Nodes
and runs the pods the scheduler binds to them as processes on this machine, each pod in a
network namespace of its own with a 10.244.0.0/16 address (see the package doc in
e2e/processnode/main.go). It needs root (namespaces, veth links, bind mounts) and Go to build.

Images map to local programs through a table this module writes: the fleetpilot image (and
the reference engine's, which holds the same package) runs the project's own environment (its
`python` and `fleetpilot` come first on PATH). Pods with any other image are refused by the
agent with ErrImagePull and an Event naming the image.

The nodes carry the `fleetpilot.dev/process-node=true:NoSchedule` taint by default, so only
pods that tolerate it land there while other tests' fake GPU nodes share the cluster.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from kubernetes import client as k8s

from fleetpilot.runtime.processes import Child, StartsAndStops, Supervisor, free_ports
from fleetpilot.testing.binaries import go_tool
from fleetpilot.testing.errors import ControlPlaneError
from fleetpilot.testing.kubeconfig import api_client

log = logging.getLogger(__name__)

#: Label on every process node, and the key of the taint it carries unless told otherwise.
PROCESS_NODE_LABEL = "fleetpilot.dev/process-node"
PROCESS_NODE_TAINT = f"{PROCESS_NODE_LABEL}=true:NoSchedule"
#: The toleration a pod needs to land on a tainted process node.
PROCESS_NODE_TOLERATION: dict[str, str] = {
    "key": PROCESS_NODE_LABEL,
    "operator": "Equal",
    "value": "true",
    "effect": "NoSchedule",
}
FLEETPILOT_IMAGE_PATTERN = "ghcr.io/fleetpilot/fleetpilot:*"
#: The CPU reference engine's image (engine_image/Dockerfile.reference): the same package and
#: torch, so the same environment runs it.
REFERENCE_IMAGE_PATTERN = "ghcr.io/fleetpilot/fleetpilot-reference:*"
#: One agent per machine: each sweeps the `fpn-` namespaces it finds at start as its own
#: leftovers and claims the `kubernetes` ClusterIP on lo, so a second one, started while
#: another test run's is up, tore that run's pods' networks down. Held from start to stop.
MACHINE_LOCK = Path("/run/fleetpilot-processnode.lock")
#: The agent prints this line once every node is registered and Ready.
READY_LINE = "processnode: ready"


def skip_reason() -> str | None:
    """Why the process node cannot run here (None: it can): it needs root and Go."""
    if os.geteuid() != 0:
        return "the process node needs root (network namespaces, veth links, bind mounts)"
    if shutil.which("go") is None:
        return "the process node is built with Go, which is not on PATH"
    if shutil.which("ip") is None:
        return "the process node needs iproute2's `ip`"
    return None


def agent_binary(*, build: bool = True) -> Path:
    """The agent, built first by its build.sh (a no-op when up to date)."""
    return go_tool("processnode", "the process node agent", build=build)


def fleetpilot_image_table(venv_bin: Path | None = None) -> dict[str, Any]:
    """The image table: the fleetpilot image and the reference engine's run this environment
    (the interpreter running this module), as their Dockerfiles' ENTRYPOINT `fleetpilot` does."""
    bin_dir = venv_bin if venv_bin is not None else Path(sys.executable).parent
    return {
        "images": [
            {
                "pattern": pattern,
                "path": [str(bin_dir)],
                "entrypoint": entrypoint,
                "env": {"PYTHONUNBUFFERED": "1"},
            }
            for pattern, entrypoint in (
                (FLEETPILOT_IMAGE_PATTERN, ["fleetpilot"]),
                (REFERENCE_IMAGE_PATTERN, ["fleetpilot", "engine", "--backend", "reference"]),
            )
        ]
    }


class ProcessNode(StartsAndStops):
    """The agent, registering `names` as nodes of the cluster whose admin kubeconfig is given.

    `backoff_base_s` is the first restart back-off (the kubelet's is 10s; tests shorten it).
    All state (image table, pod volumes and logs, the agent's log) is under `workdir`.
    """

    def __init__(
        self,
        kubeconfig: Path,
        workdir: Path,
        names: Sequence[str] = ("process-node-0",),
        *,
        cpu: str = "8",
        memory: str = "32Gi",
        gpus: int = 0,
        gpu_product: str | None = None,
        images: Mapping[str, Any] | None = None,
        backoff_base_s: float = 10.0,
        taints: Sequence[str] = (PROCESS_NODE_TAINT,),
        build: bool = True,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.workdir = workdir.resolve()
        self.names = list(names)
        self.gpus = gpus
        self.gpu_product = gpu_product
        self._args = {
            "cpu": cpu,
            "memory": memory,
            "gpus": str(gpus),
            "gpu-product": gpu_product or "",
            "backoff-base": f"{backoff_base_s}s",
            "taints": ",".join(taints),
        }
        self._images = dict(images) if images is not None else fleetpilot_image_table()
        self._build = build
        self._supervisor = Supervisor(self.workdir / "logs")
        self._child: Child | None = None
        self._volumes: list[str] = []
        self._lock: int | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / "logs" / "processnode.log"

    @property
    def pid(self) -> int:
        if self._child is None:
            raise ControlPlaneError("process node not started")
        return self._child.pid

    def alive(self) -> bool:
        return self._child is not None and self._child.alive()

    def start(self, timeout: float = 60.0, lock_timeout: float = 900.0) -> Self:
        """Start the agent and wait until every node is registered and Ready: after any other
        run's agent on this machine stopped (`MACHINE_LOCK`; up to `lock_timeout`)."""
        binary = agent_binary(build=self._build)
        self._take_machine_lock(lock_timeout)
        try:
            return self._start(binary, timeout)
        except BaseException:
            self._release_machine_lock()
            raise

    def _take_machine_lock(self, timeout: float) -> None:
        fd = os.open(MACHINE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ControlPlaneError(
                        f"another process node held {MACHINE_LOCK} for {timeout:.0f}s"
                    ) from None
                time.sleep(1.0)
        self._lock = fd

    def _release_machine_lock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor drops the flock
            self._lock = None

    def _start(self, binary: Path, timeout: float) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        table = self.workdir / "images.json"
        table.write_text(json.dumps(self._images, indent=2) + "\n")
        ports = free_ports(len(self.names))
        argv = [
            str(binary),
            "-kubeconfig", str(self.kubeconfig),
            "-nodes", ",".join(self.names),
            "-images", str(table),
            "-state-dir", str(self.workdir / "state"),
            "-ports", ",".join(str(p) for p in ports),
            *(f"-{k}={v}" for k, v in self._args.items()),
        ]  # fmt: skip
        self.log_path.unlink(missing_ok=True)
        self._child = self._supervisor.start("processnode", argv, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while READY_LINE not in self._log():
            if not self._child.alive():
                raise ControlPlaneError(f"process node exited:\n{self._child.tail(40)}")
            if time.monotonic() > deadline:
                self.stop()
                raise ControlPlaneError(f"process node not ready in {timeout:.0f}s")
            time.sleep(0.1)
        log.info("process node %s up (pid %d)", ",".join(self.names), self._child.pid)
        return self

    def _log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the agent: it stops every pod (each with its grace period) and removes its
        namespaces, links, addresses and directories. Raises if it had to be killed."""
        if self._child is None:
            return
        try:
            clean = self._supervisor.stop(self._child, grace_s=timeout)
        finally:
            self._release_machine_lock()
        if not clean:
            raise ControlPlaneError(f"process node ignored SIGTERM for {timeout:.0f}s; killed")

    def bind_claim(
        self,
        api: k8s.ApiClient,
        namespace: str,
        claim: str,
        size: str = "1Gi",
        *,
        create_claim: bool = True,
    ) -> Path:
        """Create PVC `claim`, bound to a new hostPath PersistentVolume: a directory under
        `workdir`, returned, that pods mounting the claim on these nodes read and write.

        The node has no provisioner: claims are bound here, before the pods that use them,
        as an administrator pre-binds static volumes (`claimRef` and `volumeName`). With
        `create_claim=False` only the volume is made, reserved for a claim of that name that
        someone else creates later without a storage class (the operator's model cache): the
        PersistentVolume controller binds the two when it appears.
        """
        directory = self.workdir / "volumes" / namespace / claim
        directory.mkdir(parents=True, exist_ok=True)
        name = f"{namespace}-{claim}"
        core = k8s.CoreV1Api(api)
        modes = ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany"]
        volume: Any = {
            "metadata": {"name": name, "labels": {PROCESS_NODE_LABEL: "true"}},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": modes,
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(directory), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        }
        core.create_persistent_volume(volume)
        self._volumes.append(name)
        if not create_claim:
            return directory
        claim_body: Any = {
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "volumeName": name,
                "resources": {"requests": {"storage": size}},
            },
        }
        core.create_namespaced_persistent_volume_claim(namespace, claim_body)
        return directory

    def after_stop(self) -> None:
        """Leaving ``with``: delete what the agent leaves in the cluster, its Nodes and the
        volumes `bind_claim` made."""
        with api_client(self.kubeconfig) as api:
            self.delete_volumes(api)
            self.delete_nodes(api)

    def delete_nodes(self, api: k8s.ApiClient) -> None:
        """Delete the Node objects (after stop()): with the node-lifecycle controller off, a
        stopped node would stay Ready in the API for good, and pods bound to it with it. A
        kubelet leaves its Node; a test harness should not leave dead ones to later tests."""
        core = k8s.CoreV1Api(api)
        for name in self.names:
            _delete_if_present(core.delete_node, name)

    def delete_volumes(self, api: k8s.ApiClient) -> None:
        """Delete the PersistentVolumes `bind_claim` made (they are cluster-wide)."""
        core = k8s.CoreV1Api(api)
        for name in self._volumes:
            _delete_if_present(core.delete_persistent_volume, name)
        self._volumes.clear()


def _delete_if_present(delete: Callable[[str], object], name: str) -> None:
    """``delete(name)``, where an object already gone (404) is what was wanted."""
    try:
        delete(name)
    except k8s.ApiException as e:
        if e.status != 404:
            raise


def netns_name(pod_ip: str) -> str:
    """The network namespace the agent makes for the pod at `pod_ip` (podNames in
    e2e/processnode/network.go): tests check it is gone after the pod."""
    _, _, third, fourth = pod_ip.split(".")
    return f"fpn-{third}-{fourth}"


def network_namespaces() -> set[str]:
    """Every network namespace the process node agent has made and not yet removed."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.startswith("fpn-")}
