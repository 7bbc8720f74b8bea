"""Kubeconfig files for the test clusters: the admin's, each component's, a ServiceAccount's."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config


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


def client_cert_user(cert: Path, key: Path) -> dict[str, str]:
    """A kubeconfig user that authenticates with this client certificate, embedded."""
    return {
        "client-certificate-data": base64.b64encode(cert.read_bytes()).decode(),
        "client-key-data": base64.b64encode(key.read_bytes()).decode(),
    }


def api_client(kubeconfig: str | Path) -> k8s.ApiClient:
    """A fresh, independent admin client from a kubeconfig file (or an os.pathsep-joined list)."""
    conf = k8s.Configuration()
    # kubernetes.config, unlike the generated client, has no type hints.
    k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig), client_configuration=conf, persist_config=False
    )
    return k8s.ApiClient(configuration=conf)
