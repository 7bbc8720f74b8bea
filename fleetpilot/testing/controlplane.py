"""A real Kubernetes control plane on loopback, for operator and e2e tests.

Runs etcd, kube-apiserver, kube-controller-manager and kube-scheduler as local processes (built
from Go modules by `e2e/controlplane/build.sh`, see `binaries`), with real TLS (`pki`), RBAC,
admission and controllers, so tests exercise what a cluster does rather than what a mock
believes it does. There is no kubelet: GPU nodes are Node objects registered and marked Ready
(`nodes`), and tests set pod status where a kubelet would.

Use it from Python::

    with ControlPlane(".cache/cluster") as cp:
        cp.add_gpu_node("gpu-0", "NVIDIA-H100-80GB-HBM3")
        api = cp.api_client()

or from a shell (`cli`; this is what `make cluster-up` / `make cluster-down` run)::

    python -m fleetpilot.testing.cli up --dir .cache/cluster    # prints the kubeconfig
    python -m fleetpilot.testing.cli down --dir .cache/cluster

The components run under `fleetpilot.runtime.processes.Supervisor`, each in its own process
group, stopped by pid (never by name), so two clusters on one machine never touch each other's
processes. state.json in the work folder records their pids, so `down` (another process)
adopts and stops what `up` left running.
"""

from __future__ import annotations

import json
import logging
import shutil
import ssl
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

from kubernetes import client as k8s

from fleetpilot.runtime.processes import Child, StartsAndStops, Supervisor, free_ports, http_ok
from fleetpilot.testing.binaries import ensure_binaries
from fleetpilot.testing.cluster import Cluster
from fleetpilot.testing.errors import ControlPlaneError
from fleetpilot.testing.kubeconfig import client_cert_user, write_kubeconfig
from fleetpilot.testing.pki import Pki

__all__ = ["STATE_FILE", "ControlPlane"]

log = logging.getLogger(__name__)

#: Service ClusterIPs are only allocated, never routed: there is no kube-proxy, and nothing here
#: connects to them.
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"

#: Without a kubelet nothing renews node heartbeats, so the node-lifecycle controller would mark
#: every fake node NotReady after ~40 s, taint it and evict its pods. Everything else stays on.
CONTROLLERS = "*,-node-lifecycle-controller"
#: TaintNodesByCondition puts node.kubernetes.io/not-ready:NoSchedule on every new Node, and only
#: a kubelet's status update would remove it, so the scheduler would never place a pod on a fake
#: node. ServiceAccount admission stays on: the controller-manager runs the service-account and
#: token controllers, as in a real cluster. OwnerReferencesPermissionEnforcement is on, as in
#: OpenShift: an ownerReference with blockOwnerDeletion needs `update` on the owner's
#: `finalizers` subresource, so the chart's RBAC is tested against the stricter clusters.
DISABLED_ADMISSION_PLUGINS = "TaintNodesByCondition"
ENABLED_ADMISSION_PLUGINS = "NodeRestriction,OwnerReferencesPermissionEnforcement"

STATE_FILE = "state.json"
ADMIN_KUBECONFIG = "admin.kubeconfig"

#: Each readiness probe's own timeout; the start() deadline bounds the wait as a whole.
_PROBE_TIMEOUT_S = 3.0
#: Log lines quoted when a component fails to start.
_LOG_LINES = 40


class ControlPlane(Cluster, StartsAndStops):
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on loopback.

    `workdir` holds everything: certificates, kubeconfigs, etcd data, logs and state.json (pids
    and ports, so `down` or another process can stop what `up` started). start() wipes earlier
    data there: each start is a fresh cluster.
    """

    fake_nodes = True

    def __init__(
        self,
        workdir: Path | str,
        *,
        bin_dir: Path | None = None,
        build: bool = True,
        die_with_parent: bool = True,
        verbosity: int = 1,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        super().__init__(self.workdir / ADMIN_KUBECONFIG)
        self._bin_dir = bin_dir
        self._build = build
        self._die_with_parent = die_with_parent
        self._verbosity = verbosity
        # Made by start() or adopt(): its log folder is wiped by start(), and a plane that was
        # never started must not create one.
        self._supervisor: Supervisor | None = None
        self._ports: dict[str, int] = {}
        self._pki = Pki(self.workdir / "pki")

    # ---- public state

    @property
    def server(self) -> str:
        if "apiserver" not in self._ports:
            raise ControlPlaneError("control plane not started")
        return f"https://127.0.0.1:{self._ports['apiserver']}"

    @property
    def pids(self) -> dict[str, int]:
        """Pid (= process group id) of each component started."""
        return {child.name: child.pid for child in self._children}

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    def _default_kubeconfig_path(self, stem: str) -> Path:
        return self.workdir / f"{stem}.kubeconfig"

    @property
    def _children(self) -> list[Child]:
        return self._supervisor.children if self._supervisor is not None else []

    def running(self) -> bool:
        return bool(self._children) and all(child.alive() for child in self._children)

    def leftover_processes(self) -> list[int]:
        """Live processes in any of our components' process groups (empty after stop())."""
        return self._supervisor.leftovers() if self._supervisor is not None else []

    # ---- lifecycle

    @classmethod
    def adopt(cls, workdir: Path | str) -> ControlPlane | None:
        """The control plane whose state.json is in `workdir`, if any of it still runs."""
        plane = cls(workdir, build=False, die_with_parent=False)
        state_file = plane.workdir / STATE_FILE
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            return None
        plane._ports = {str(k): int(v) for k, v in state["ports"].items()}
        plane._supervisor = Supervisor(plane.logs, die_with_parent=False)
        for p in state["processes"]:
            plane._supervisor.adopt(p["name"], int(p["pid"]), str(p["exe"]), Path(p["log"]))
        if not any(child.alive() for child in plane._children):
            return None
        return plane

    def start(self, timeout: float = 180.0) -> Self:
        """Start all components and wait until the cluster schedules and runs controllers.

        Returns only once the API server is ready, the controller-manager and scheduler are
        healthy and the controller-manager has created the `default` ServiceAccount (so
        namespaces are usable for pods). On failure everything started is stopped again and the
        error carries the failing component's log tail.
        """
        if self._children:
            raise ControlPlaneError("already started")
        previous = ControlPlane.adopt(self.workdir)
        if previous is not None:
            raise ControlPlaneError(
                f"a control plane from {self.workdir} still runs (pids {previous.pids}); stop it "
                "first (python -m fleetpilot.testing.cli down --dir ...)"
            )
        bin_dir = ensure_binaries(self._bin_dir, build=self._build)
        began = time.monotonic()
        for sub in ("pki", "etcd", "logs", "kcm", "scheduler"):
            shutil.rmtree(self.workdir / sub, ignore_errors=True)
        for stale in (STATE_FILE, ADMIN_KUBECONFIG):
            (self.workdir / stale).unlink(missing_ok=True)
        self._supervisor = Supervisor(self.logs, die_with_parent=self._die_with_parent)
        self._pki.create()
        names = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler")
        self._ports = dict(zip(names, free_ports(len(names)), strict=True))
        try:
            self._start_all(bin_dir, began + timeout)
        except BaseException:
            self.stop()
            raise
        self._write_state()
        log.info(
            "control plane up in %.1fs at %s (kubeconfig %s)",
            time.monotonic() - began,
            self.server,
            self.kubeconfig,
        )
        return self

    def _start_all(self, bin_dir: Path, deadline: float) -> None:
        pki = self._pki
        ca = ssl.create_default_context(cafile=str(pki.path("ca.crt")))

        def answers(url: str, context: ssl.SSLContext | None = ca) -> Callable[[], bool]:
            return lambda: http_ok(url, _PROBE_TIMEOUT_S, context)

        serving = ["--tls-cert-file", str(pki.path("serving.crt")),
                   "--tls-private-key-file", str(pki.path("serving.key"))]  # fmt: skip

        etcd_url = f"http://127.0.0.1:{self._ports['etcd']}"
        peer_url = f"http://127.0.0.1:{self._ports['etcd-peer']}"
        etcd = self._spawn(bin_dir, "etcd", [
            "--name", "fleetpilot-test",
            "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", etcd_url,
            "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"fleetpilot-test={peer_url}",
            # Throwaway data: skipping fsync makes every write (and so every test) faster.
            "--unsafe-no-fsync",
            "--log-level", "warn",
        ])  # fmt: skip
        self._wait("etcd /health", answers(f"{etcd_url}/health", None), [etcd], deadline)

        apiserver = self._spawn(bin_dir, "kube-apiserver", [
            "--etcd-servers", etcd_url,
            "--bind-address", "127.0.0.1",
            "--advertise-address", "127.0.0.1",
            "--secure-port", str(self._ports["apiserver"]),
            *serving,
            "--client-ca-file", str(pki.path("ca.crt")),
            "--authorization-mode", "Node,RBAC",
            "--enable-admission-plugins", ENABLED_ADMISSION_PLUGINS,
            "--disable-admission-plugins", DISABLED_ADMISSION_PLUGINS,
            "--service-cluster-ip-range", SERVICE_CLUSTER_IP_RANGE,
            # Front proxy (aggregation layer), as kubeadm sets it up; without it every
            # component logs errors about the missing requestheader CA.
            "--requestheader-client-ca-file", str(pki.path("front-proxy-ca.crt")),
            "--requestheader-allowed-names", "front-proxy-client",
            "--requestheader-username-headers", "X-Remote-User",
            "--requestheader-group-headers", "X-Remote-Group",
            "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
            "--proxy-client-cert-file", str(pki.path("front-proxy-client.crt")),
            "--proxy-client-key-file", str(pki.path("front-proxy-client.key")),
            "--service-account-issuer", SERVICE_ACCOUNT_ISSUER,
            "--service-account-key-file", str(pki.path("sa.pub")),
            "--service-account-signing-key-file", str(pki.path("service-account.key")),
            # The default (lease) would publish 127.0.0.1 as the `kubernetes` Service endpoint,
            # which Endpoints validation refuses; nothing in-cluster needs that endpoint here.
            "--endpoint-reconciler-type", "none",
            "--allow-privileged",
            "--profiling=false",
            "--v", str(self._verbosity),
        ])  # fmt: skip
        server = self.server
        self._wait(
            "kube-apiserver /readyz",
            answers(f"{server}/readyz"),
            [etcd, apiserver],
            deadline,
        )
        ca_pem = pki.path("ca.crt").read_bytes()
        write_kubeconfig(
            self.kubeconfig, server, ca_pem,
            client_cert_user(pki.path("admin.crt"), pki.path("admin.key")),
            name="fleetpilot-test",
        )  # fmt: skip
        kcm_kubeconfig = write_kubeconfig(
            self.workdir / "kcm" / "kubeconfig", server, ca_pem,
            client_cert_user(pki.path("controller-manager.crt"),
                              pki.path("controller-manager.key")),
            name="kube-controller-manager",
        )  # fmt: skip
        sched_kubeconfig = write_kubeconfig(
            self.workdir / "scheduler" / "kubeconfig", server, ca_pem,
            client_cert_user(pki.path("scheduler.crt"), pki.path("scheduler.key")),
            name="kube-scheduler",
        )  # fmt: skip

        kcm = self._spawn(bin_dir, "kube-controller-manager", [
            "--kubeconfig", str(kcm_kubeconfig),
            "--authentication-kubeconfig", str(kcm_kubeconfig),
            "--authorization-kubeconfig", str(kcm_kubeconfig),
            "--bind-address", "127.0.0.1",
            "--secure-port", str(self._ports["controller-manager"]),
            *serving,
            # One instance only: skip the leader-election lease wait.
            "--leader-elect=false",
            "--controllers", CONTROLLERS,
            # Each controller acts as its own ServiceAccount, as in kubeadm clusters, so RBAC
            # bootstrap roles are exercised too.
            "--use-service-account-credentials",
            "--service-account-private-key-file", str(pki.path("service-account.key")),
            "--root-ca-file", str(pki.path("ca.crt")),
            "--service-cluster-ip-range", SERVICE_CLUSTER_IP_RANGE,
            # The default is under /usr/libexec, which the controller-manager would create.
            "--flex-volume-plugin-dir", str(self.workdir / "kcm" / "flexvolume"),
            "--profiling=false",
            "--v", str(self._verbosity),
        ])  # fmt: skip
        scheduler = self._spawn(bin_dir, "kube-scheduler", [
            "--kubeconfig", str(sched_kubeconfig),
            "--authentication-kubeconfig", str(sched_kubeconfig),
            "--authorization-kubeconfig", str(sched_kubeconfig),
            "--bind-address", "127.0.0.1",
            "--secure-port", str(self._ports["scheduler"]),
            *serving,
            "--leader-elect=false",
            "--profiling=false",
            "--v", str(self._verbosity),
        ])  # fmt: skip
        everything = [etcd, apiserver, kcm, scheduler]
        kcm_url = f"https://127.0.0.1:{self._ports['controller-manager']}/healthz"
        self._wait("kube-controller-manager /healthz", answers(kcm_url),
                   everything, deadline)  # fmt: skip
        sched_url = f"https://127.0.0.1:{self._ports['scheduler']}/readyz"
        self._wait("kube-scheduler /readyz", answers(sched_url),
                   everything, deadline)  # fmt: skip
        with self.api_client() as api:
            core = k8s.CoreV1Api(api)

            def default_service_account() -> bool:
                try:
                    core.read_namespaced_service_account("default", "default")
                except k8s.ApiException:
                    return False
                return True

            self._wait("ServiceAccount default/default (controller-manager working)",
                       default_service_account, everything, deadline)  # fmt: skip

    def _spawn(self, bin_dir: Path, name: str, args: Sequence[str]) -> Child:
        assert self._supervisor is not None
        exe = str((bin_dir / name).resolve())  # resolved: adopt() matches it against /proc
        child = self._supervisor.start(name, [exe, *args], cwd=self.workdir)
        log.info("started %s (pid %d, log %s)", name, child.pid, child.log_path)
        return child

    def _wait(
        self,
        what: str,
        check: Callable[[], bool],
        children: Sequence[Child],
        deadline: float,
    ) -> None:
        """Wait for `check`, failing at once with its log when any of `children` exits (a
        component that depends on another starts after it and is checked with it)."""
        began = time.monotonic()
        while True:
            for child in children:
                if not child.alive():
                    raise ControlPlaneError(
                        f"{child.name} exited while waiting for {what}; "
                        f"last lines of {child.log_path}:\n{child.tail(_LOG_LINES)}"
                    )
            if check():
                log.debug("%s after %.1fs", what, time.monotonic() - began)
                return
            if time.monotonic() > deadline:
                newest = children[-1]
                raise ControlPlaneError(
                    f"timed out waiting for {what}; last lines of {newest.log_path}:\n"
                    f"{newest.tail(_LOG_LINES)}"
                )
            time.sleep(0.2)

    def _write_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ports": self._ports,
            "processes": [
                {"name": c.name, "pid": c.pid, "exe": c.argv[0], "log": str(c.log_path)}
                for c in self._children
            ],
        }
        tmp = self.workdir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.workdir / STATE_FILE)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every component by pid, newest first, and make sure none of them is left.

        SIGTERM lets each shut down cleanly; whatever still runs after `timeout` seconds gets
        SIGKILL. Raises when a process of ours survives even that.
        """
        left: list[int] = []
        if self._supervisor is not None:
            pids = self.pids
            for name in self._supervisor.stop_in_turn(timeout):
                log.warning(
                    "%s (pid %d) ignored SIGTERM for %.0fs; killed it", name, pids[name], timeout
                )
            # SIGKILL reached every member of each group; give the kernel time to reap them.
            left = self._supervisor.leftovers(wait_s=timeout)
        (self.workdir / STATE_FILE).unlink(missing_ok=True)
        if not left:  # a fresh start wipes it anyway; free the disk (etcd preallocates its WAL)
            shutil.rmtree(self.workdir / "etcd", ignore_errors=True)
        if left:
            raise ControlPlaneError(f"processes still running after stop: {left}")
        if self._children:
            log.info("control plane in %s stopped", self.workdir)
