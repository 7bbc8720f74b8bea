"""One way to reach the API server: in-cluster credentials, else a kubeconfig."""

from __future__ import annotations

from kubernetes import client as k8s
from kubernetes import config as k8s_config


def connect(kubeconfig: str | None = None) -> k8s.ApiClient:
    """An API client from the pod's service account when running in a cluster, else from
    ``kubeconfig`` (``None``: ``$KUBECONFIG`` or ``~/.kube/config``)."""
    try:
        k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
    except k8s_config.ConfigException:
        api: k8s.ApiClient = k8s_config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        return api
    return k8s.ApiClient()
