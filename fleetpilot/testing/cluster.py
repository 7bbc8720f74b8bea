"""A Kubernetes cluster the tests talk to, given by a kubeconfig: the base of the control plane
we start (`controlplane.ControlPlane`) and, as `ExistingCluster`, one someone else runs (kind, a
real GPU cluster) for `FLEETPILOT_E2E_CLUSTER=1`.

What differs between the two is what the tests may do to them: only on a cluster we started are
fake nodes registered and kubeconfigs written beside the admin's.
"""

from __future__ import annotations

import os
from pathlib import Path

from kubernetes import client as k8s

from fleetpilot.testing.errors import ControlPlaneError
from fleetpilot.testing.kubeconfig import api_client, write_kubeconfig
from fleetpilot.testing.nodes import register_gpu_node


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
        return api_client(self._kubeconfig)

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
        """Register a fake GPU node, Ready and untainted (see `nodes.register_gpu_node`): only on
        a cluster we started (`fake_nodes`), never on someone else's."""
        if not self.fake_nodes:
            raise ControlPlaneError("refusing to register fake nodes on a cluster we did not start")
        with self.api_client() as api:
            register_gpu_node(api, name, product, gpus, cpu=cpu, memory=memory, pods=pods)

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
