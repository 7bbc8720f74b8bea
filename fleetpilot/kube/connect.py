"""One way to reach the API server: in-cluster credentials, else a kubeconfig."""

from __future__ import annotations

from kubernetes import client as k8s
from kubernetes import config as k8s_config

# Connections kept open to the API server. The client's default is five per CPU (ten on two
# cores), and the operator's reconcile, status-refresh and autoscaler threads share one client:
# past the pool, urllib3 drops each returned connection and the next request pays a new TLS
# handshake.
CONNECTION_POOL_SIZE = 32


def connect(kubeconfig: str | None = None) -> k8s.ApiClient:
    """An API client from the pod's service account when running in a cluster, else from
    ``kubeconfig`` (``None``: ``$KUBECONFIG`` or ``~/.kube/config``)."""
    configuration = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)  # type: ignore[no-untyped-call]
    configuration.connection_pool_maxsize = CONNECTION_POOL_SIZE
    return k8s.ApiClient(configuration)
