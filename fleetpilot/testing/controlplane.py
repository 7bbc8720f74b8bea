"""A real Kubernetes control plane on loopback, for operator and e2e tests.

Runs etcd, kube-apiserver, kube-controller-manager and kube-scheduler as local processes (built
from Go modules by `e2e/controlplane/build.sh`), with real TLS, RBAC, admission and controllers,
so tests exercise what a cluster does rather than what a mock believes it does. There is no
kubelet: GPU nodes are Node objects that this module registers and marks Ready, and tests set pod
status where a kubelet would.

Use it from Python::

    with ControlPlane(".cache/cluster") as cp:
        cp.add_gpu_node("gpu-0", "NVIDIA-H100-80GB-HBM3")
        api = cp.api_client()

or from a shell (this is what `make cluster-up` / `make cluster-down` run)::

    python -m fleetpilot.testing.controlplane up --dir .cache/cluster    # prints the kubeconfig
    python -m fleetpilot.testing.controlplane down --dir .cache/cluster

Every component runs in its own process group and is stopped by pid (never by name), so two
clusters on one machine never touch each other's processes.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from fleetpilot.runtime.processes import die_with_parent, group_members, running

log = logging.getLogger(__name__)

#: Start order; stop runs in reverse so no component outlives what it depends on.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
#: Label on every node this module registers, so tests and humans can tell fakes from real nodes.
FAKE_NODE_LABEL = "fleetpilot.dev/fake-node"

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
#: token controllers, as in a real cluster.
DISABLED_ADMISSION_PLUGINS = "TaintNodesByCondition"
ENABLED_ADMISSION_PLUGINS = "NodeRestriction"

STATE_FILE = "state.json"
ADMIN_KUBECONFIG = "admin.kubeconfig"

_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier = hash
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
authorityKeyIdentifier = keyid
subjectAltName = IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,\
DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.96.0.1
"""


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started, used or stopped as asked."""


# --------------------------------------------------------------------------- binaries


def repo_root() -> Path | None:
    """The source checkout this module runs from, or None when installed without one."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "e2e" / "controlplane" / "build.sh").is_file() else None


def default_bin_dir() -> Path:
    """Where build.sh puts the binaries: $FLEETPILOT_CONTROLPLANE_BIN, else the checkout's cache."""
    env = os.environ.get("FLEETPILOT_CONTROLPLANE_BIN")
    if env:
        return Path(env)
    root = repo_root()
    if root is None:
        raise ControlPlaneError(
            "no fleetpilot checkout found next to this module; set FLEETPILOT_CONTROLPLANE_BIN "
            "to a folder holding etcd, kube-apiserver, kube-controller-manager, kube-scheduler"
        )
    return root / ".cache" / "controlplane" / "bin"


def ensure_binaries(bin_dir: Path | None = None, *, build: bool = True) -> Path:
    """Return a folder holding all four binaries, building them first when `build` is set.

    build.sh is a no-op when the binaries are up to date, so calling this every time is cheap;
    the first build on a fresh machine takes 10-25 minutes on 2 cores.
    """
    target = bin_dir if bin_dir is not None else default_bin_dir()
    root = repo_root()
    if build and root is not None:
        script = root / "e2e" / "controlplane" / "build.sh"
        env = dict(os.environ, FLEETPILOT_CONTROLPLANE_BIN=str(target))
        # stdout=2: the CLI prints only the kubeconfig path on stdout.
        result = subprocess.run(["bash", str(script)], env=env, stdout=2, check=False)
        if result.returncode != 0:
            raise ControlPlaneError(
                f"{script} failed (exit {result.returncode}); its output above names the step"
            )
    missing = [name for name in COMPONENTS if not os.access(target / name, os.X_OK)]
    if missing:
        raise ControlPlaneError(
            f"missing control-plane binaries in {target}: {', '.join(missing)}; "
            "run e2e/controlplane/build.sh"
        )
    return target


# --------------------------------------------------------------------------- small helpers


def free_ports(count: int) -> list[int]:
    """Ask the kernel for `count` distinct free loopback ports.

    All sockets stay open until every port is picked so no port is handed out twice. Another
    process can still grab one before a component binds it; start() then fails with that
    component's log rather than hanging.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _no_proxy_opener(context: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    # Loopback probes must never go through an HTTP(S)_PROXY from the environment.
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers)


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    """True when `url` answers 200; any connection or HTTP error reads as not ready yet."""
    try:
        with _no_proxy_opener(context).open(url, timeout=3) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def write_kubeconfig(
    path: Path, server: str, ca_pem: bytes | None, user: dict[str, str], *, name: str
) -> Path:
    """Write a single-context kubeconfig with credentials embedded, readable by its owner only.

    Embedding (rather than pointing at files) keeps the kubeconfig usable after it is copied.
    """
    cluster: dict[str, str] = {"server": server}
    if ca_pem is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    else:
        cluster["insecure-skip-tls-verify"] = "true"
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(doc, fh, sort_keys=False)
    tmp.replace(path)
    return path


def _client_cert_user(cert: Path, key: Path) -> dict[str, str]:
    return {
        "client-certificate-data": base64.b64encode(cert.read_bytes()).decode(),
        "client-key-data": base64.b64encode(key.read_bytes()).decode(),
    }


# --------------------------------------------------------------------------- PKI


class _Pki:
    """A throwaway CA and the certificates a control plane needs, made with the openssl CLI.

    The openssl CLI is on every machine image we use, which keeps `cryptography` out of the
    dependencies. EC P-256 keys, because they are generated instantly.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.config = directory / "openssl.cnf"

    def path(self, name: str) -> Path:
        return self.dir / name

    def _openssl(self, *args: str) -> None:
        result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ControlPlaneError(f"openssl {args[0]} failed: {result.stderr.strip()}")

    def _key(self, name: str) -> Path:
        key = self.path(f"{name}.key")
        self._openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key))
        key.chmod(0o600)
        return key

    def create(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(_OPENSSL_CONFIG)
        ca_key = self._key("ca")
        self._openssl(
            "req", "-x509", "-new", "-key", str(ca_key), "-sha256", "-days", "3650",
            "-subj", "/CN=fleetpilot-test-ca", "-config", str(self.config),
            "-extensions", "ca", "-out", str(self.path("ca.crt")),
        )  # fmt: skip
        # One serving certificate for every component: all listen on 127.0.0.1 only.
        self._leaf("serving", "/CN=fleetpilot-test-serving", "server")
        self._leaf("admin", "/O=system:masters/CN=fleetpilot-admin", "client")
        self._leaf("controller-manager", "/CN=system:kube-controller-manager", "client")
        self._leaf("scheduler", "/CN=system:kube-scheduler", "client")
        # The aggregation layer's own CA, separate as in kubeadm: a certificate from it lets the
        # API server assert any identity to an aggregated API server (metrics, custom metrics).
        front_key = self._key("front-proxy-ca")
        self._openssl(
            "req", "-x509", "-new", "-key", str(front_key), "-sha256", "-days", "3650",
            "-subj", "/CN=fleetpilot-test-front-proxy-ca", "-config", str(self.config),
            "-extensions", "ca", "-out", str(self.path("front-proxy-ca.crt")),
        )  # fmt: skip
        self._leaf("front-proxy-client", "/CN=front-proxy-client", "client", ca="front-proxy-ca")
        sa_key = self._key("service-account")
        self._openssl("ec", "-in", str(sa_key), "-pubout", "-out", str(self.path("sa.pub")))

    def _leaf(self, name: str, subject: str, kind: str, *, ca: str = "ca") -> None:
        key = self._key(name)
        csr = self.path(f"{name}.csr")
        self._openssl(
            "req", "-new", "-key", str(key), "-subj", subject, "-config", str(self.config),
            "-out", str(csr),
        )  # fmt: skip
        serial = str(int.from_bytes(os.urandom(8)))
        self._openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.path(f"{ca}.crt")),
            "-CAkey", str(self.path(f"{ca}.key")), "-set_serial", serial,
            "-days", "3650", "-sha256", "-extfile", str(self.config), "-extensions", kind,
            "-out", str(self.path(f"{name}.crt")),
        )  # fmt: skip
        csr.unlink()


# --------------------------------------------------------------------------- processes


@dataclass
class _Process:
    name: str
    pid: int
    exe: str
    log: Path
    popen: subprocess.Popen[bytes] | None = None  # None when adopted from a state file

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return running(self.pid, self.exe)

    def signal_group(self, sig: signal.Signals) -> None:
        # Each component leads its own session, so its pid is its process group id.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


# --------------------------------------------------------------------------- clusters


class Cluster:
    """A cluster the tests can talk to, given by a kubeconfig.

    The base for ControlPlane, and used as is (ExistingCluster) for KUBECONFIG clusters such
    as kind or a real GPU cluster.
    """

    #: Whether add_gpu_node may register fake nodes: only on a cluster we started ourselves.
    fake_nodes = False

    def __init__(self, kubeconfig: Path | str) -> None:
        self._kubeconfig = str(kubeconfig)

    @property
    def kubeconfig(self) -> Path:
        """Path of an admin kubeconfig (the first one, for a ':'-separated KUBECONFIG)."""
        return Path(self._kubeconfig.split(os.pathsep)[0])

    @property
    def server(self) -> str:
        """The API server URL."""
        with self.api_client() as api:
            return str(api.configuration.host)

    def api_client(self) -> k8s.ApiClient:
        """A fresh, independent client for this cluster (safe to use from any test)."""
        conf = k8s.Configuration()
        # kubernetes.config, unlike the generated client, has no type hints.
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=self._kubeconfig, client_configuration=conf, persist_config=False
        )
        return k8s.ApiClient(configuration=conf)

    def add_gpu_node(
        self,
        name: str,
        product: str,
        gpus: int = 8,
        *,
        cpu: str = "96",
        memory: str = "1Ti",
        pods: int = 110,
    ) -> None:
        """Register a fake GPU node (ControlPlane only)."""
        raise ControlPlaneError("refusing to register fake nodes on a cluster we did not start")

    def _default_kubeconfig_path(self, stem: str) -> Path:
        raise ControlPlaneError("pass a path: this is not a cluster the tests started")

    def service_account_kubeconfig(
        self,
        namespace: str,
        name: str,
        path: Path | None = None,
        *,
        expiration_seconds: int = 3600,
    ) -> Path:
        """Create ServiceAccount `namespace/name` (if needed) and write a kubeconfig for it.

        The token comes from the TokenRequest API, so requests made with this kubeconfig are
        authorized by RBAC exactly as an in-cluster operator's would be. The namespace must exist.
        `path` defaults to the control plane's workdir; on other clusters it must be given, so
        nothing is ever written beside someone's own kubeconfig.
        """
        with self.api_client() as api:
            core = k8s.CoreV1Api(api)
            try:
                core.create_namespaced_service_account(
                    namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name=name))
                )
            except k8s.ApiException as exc:
                if exc.status != 409:
                    raise
            request = k8s.AuthenticationV1TokenRequest(
                spec=k8s.V1TokenRequestSpec(expiration_seconds=expiration_seconds)
            )
            answer = core.create_namespaced_service_account_token(name, namespace, request)
            if answer.status is None or not answer.status.token:
                raise ControlPlaneError(f"TokenRequest for {namespace}/{name} returned no token")
            token = answer.status.token
            conf = api.configuration
            ca_pem: bytes | None = None
            if conf.ssl_ca_cert:
                ca_pem = Path(conf.ssl_ca_cert).read_bytes()
            elif conf.verify_ssl:
                raise ControlPlaneError("the admin kubeconfig names no CA; cannot pin the server")
            if path is None:
                path = self._default_kubeconfig_path(f"sa-{namespace}-{name}")
            return write_kubeconfig(
                path,
                str(conf.host),
                ca_pem,
                {"token": token},
                name=f"{namespace}-{name}",
            )


class ExistingCluster(Cluster):
    """A cluster someone else runs (KUBECONFIG); we never add nodes to it or stop it."""

    @classmethod
    def from_env(cls) -> ExistingCluster:
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise ControlPlaneError("KUBECONFIG is not set")
        return cls(kubeconfig)


class ControlPlane(Cluster):
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
        self._procs: list[_Process] = []
        self._ports: dict[str, int] = {}
        self._pki = _Pki(self.workdir / "pki")

    # ---- public state

    @property
    def server(self) -> str:
        if "apiserver" not in self._ports:
            raise ControlPlaneError("control plane not started")
        return f"https://127.0.0.1:{self._ports['apiserver']}"

    @property
    def pids(self) -> dict[str, int]:
        """Pid (= process group id) of each component started."""
        return {proc.name: proc.pid for proc in self._procs}

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    def _default_kubeconfig_path(self, stem: str) -> Path:
        return self.workdir / f"{stem}.kubeconfig"

    def running(self) -> bool:
        return bool(self._procs) and all(proc.alive() for proc in self._procs)

    def leftover_processes(self) -> list[int]:
        """Live processes in any of our components' process groups (empty after stop())."""
        return group_members({proc.pid for proc in self._procs})

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

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
        plane._procs = [
            _Process(p["name"], int(p["pid"]), str(p["exe"]), Path(p["log"]))
            for p in state["processes"]
        ]
        if not any(proc.alive() for proc in plane._procs):
            return None
        return plane

    def start(self, timeout: float = 180.0) -> Self:
        """Start all components and wait until the cluster schedules and runs controllers.

        Returns only once the API server is ready, the controller-manager and scheduler are
        healthy and the controller-manager has created the `default` ServiceAccount (so
        namespaces are usable for pods). On failure everything started is stopped again and the
        error carries the failing component's log tail.
        """
        if self._procs:
            raise ControlPlaneError("already started")
        previous = ControlPlane.adopt(self.workdir)
        if previous is not None:
            raise ControlPlaneError(
                f"a control plane from {self.workdir} still runs (pids {previous.pids}); stop it "
                "first (python -m fleetpilot.testing.controlplane down --dir ...)"
            )
        bin_dir = ensure_binaries(self._bin_dir, build=self._build)
        began = time.monotonic()
        for sub in ("pki", "etcd", "logs", "kcm", "scheduler"):
            shutil.rmtree(self.workdir / sub, ignore_errors=True)
        for stale in (STATE_FILE, ADMIN_KUBECONFIG):
            (self.workdir / stale).unlink(missing_ok=True)
        self.logs.mkdir(parents=True)
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
        self._wait("etcd /health", lambda: _http_ok(f"{etcd_url}/health"), [etcd], deadline)

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
            lambda: _http_ok(f"{server}/readyz", ca),
            [etcd, apiserver],
            deadline,
        )
        ca_pem = pki.path("ca.crt").read_bytes()
        write_kubeconfig(
            self.kubeconfig, server, ca_pem,
            _client_cert_user(pki.path("admin.crt"), pki.path("admin.key")),
            name="fleetpilot-test",
        )  # fmt: skip
        kcm_kubeconfig = write_kubeconfig(
            self.workdir / "kcm" / "kubeconfig", server, ca_pem,
            _client_cert_user(pki.path("controller-manager.crt"),
                              pki.path("controller-manager.key")),
            name="kube-controller-manager",
        )  # fmt: skip
        sched_kubeconfig = write_kubeconfig(
            self.workdir / "scheduler" / "kubeconfig", server, ca_pem,
            _client_cert_user(pki.path("scheduler.crt"), pki.path("scheduler.key")),
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
        self._wait("kube-controller-manager /healthz", lambda: _http_ok(kcm_url, ca),
                   everything, deadline)  # fmt: skip
        sched_url = f"https://127.0.0.1:{self._ports['scheduler']}/readyz"
        self._wait("kube-scheduler /readyz", lambda: _http_ok(sched_url, ca),
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

    def _spawn(self, bin_dir: Path, name: str, args: Sequence[str]) -> _Process:
        exe = str((bin_dir / name).resolve())
        log_path = self.logs / f"{name}.log"
        with log_path.open("ab") as log_file:
            popen = subprocess.Popen(
                [exe, *args],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,  # own process group: stop() signals exactly this tree
                preexec_fn=die_with_parent(os.getpid()) if self._die_with_parent else None,
            )
        proc = _Process(name, popen.pid, exe, log_path, popen)
        self._procs.append(proc)
        log.info("started %s (pid %d, log %s)", name, popen.pid, log_path)
        return proc

    def _wait(
        self,
        what: str,
        check: Callable[[], bool],
        procs: Sequence[_Process],
        deadline: float,
    ) -> None:
        began = time.monotonic()
        while True:
            for proc in procs:
                if not proc.alive():
                    raise ControlPlaneError(
                        f"{proc.name} exited while waiting for {what}; "
                        f"last lines of {proc.log}:\n{_tail(proc.log)}"
                    )
            if check():
                log.debug("%s after %.1fs", what, time.monotonic() - began)
                return
            if time.monotonic() > deadline:
                newest = procs[-1]
                raise ControlPlaneError(
                    f"timed out waiting for {what}; last lines of {newest.log}:\n"
                    f"{_tail(newest.log)}"
                )
            time.sleep(0.2)

    def _write_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ports": self._ports,
            "processes": [
                {"name": p.name, "pid": p.pid, "exe": p.exe, "log": str(p.log)} for p in self._procs
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
        pgids = {proc.pid for proc in self._procs}
        for proc in reversed(self._procs):
            if not proc.alive():
                continue
            proc.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while proc.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.alive():
                log.warning("%s (pid %d) ignored SIGTERM; killing it", proc.name, proc.pid)
            proc.signal_group(signal.SIGKILL)  # also any stray member of its group
        for proc in self._procs:
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while (left := group_members(pgids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        (self.workdir / STATE_FILE).unlink(missing_ok=True)
        if not left:  # a fresh start wipes it anyway; free the disk (etcd preallocates its WAL)
            shutil.rmtree(self.workdir / "etcd", ignore_errors=True)
        if left:
            raise ControlPlaneError(f"processes still running after stop: {left}")
        if self._procs:
            log.info("control plane in %s stopped", self.workdir)

    # ---- fake nodes

    def add_gpu_node(
        self,
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
        now = _now()

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
        with self.api_client() as api:
            core = k8s.CoreV1Api(api)
            core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=name, labels=labels)))
            core.patch_node_status(
                name, {"status": status}, _content_type="application/merge-patch+json"
            )
        log.info("registered fake node %s: %d x %s", name, gpus, product)


# --------------------------------------------------------------------------- CLI

DEFAULT_NODES = ("gpu-h100-0=NVIDIA-H100-80GB-HBM3:8", "gpu-a100-0=NVIDIA-A100-SXM4-80GB:8")


def _parse_node(spec: str) -> tuple[str, str, int]:
    name, _, rest = spec.partition("=")
    product, _, gpus = rest.partition(":")
    if not name or not product:
        raise argparse.ArgumentTypeError(f"expected NAME=PRODUCT[:GPUS], got {spec!r}")
    return name, product, int(gpus or "8")


def main(argv: Sequence[str] | None = None) -> int:
    """`up` starts a detached control plane and prints its kubeconfig path; `down` stops it."""
    parser = argparse.ArgumentParser(
        prog="python -m fleetpilot.testing.controlplane", description=__doc__.split("\n")[0]
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=Path(".cache/cluster"), help="work folder")
    parser.add_argument("--bin-dir", type=Path, default=None, help="folder with the binaries")
    parser.add_argument("--no-build", action="store_true", help="do not run build.sh first")
    parser.add_argument(
        "--gpu-node",
        action="append",
        type=_parse_node,
        metavar="NAME=PRODUCT[:GPUS]",
        help=f"fake GPU node to register (repeatable; default: {', '.join(DEFAULT_NODES)})",
    )
    parser.add_argument("--no-gpu-nodes", action="store_true", help="register no fake nodes")
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    running = ControlPlane.adopt(args.dir)
    if args.command == "status":
        if running is None:
            print("not running", file=sys.stderr)
            return 1
        print(running.kubeconfig)
        return 0
    if args.command == "down":
        if running is None:
            print(f"no control plane running in {args.dir}", file=sys.stderr)
            return 0
        running.stop()
        return 0
    if running is not None:
        if running.running():
            print(f"already running: {running.server}", file=sys.stderr)
            print(running.kubeconfig)
            return 0
        print("stopping the remains of a broken control plane", file=sys.stderr)
        running.stop()
    nodes: list[tuple[str, str, int]] = []
    if not args.no_gpu_nodes:
        nodes = args.gpu_node or [_parse_node(spec) for spec in DEFAULT_NODES]
    plane = ControlPlane(
        args.dir, bin_dir=args.bin_dir, build=not args.no_build, die_with_parent=False
    )
    try:
        plane.start(timeout=args.timeout)
        for name, product, gpus in nodes:
            plane.add_gpu_node(name, product, gpus)
    except BaseException:
        plane.stop()
        raise
    print(plane.kubeconfig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
