"""connect(): the operator and the router reach the API server the same way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from fleetpilot.kube.connect import CONNECTION_POOL_SIZE, connect


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t0ken"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def test_outside_a_cluster_the_kubeconfig_names_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No service-account environment: the client talks to the kubeconfig's server."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    api = connect(str(_kubeconfig(tmp_path / "config", "https://10.1.2.3:6443")))
    assert api.configuration.host == "https://10.1.2.3:6443"
    assert_pool_holds_every_thread(api)


def assert_pool_holds_every_thread(api: k8s.ApiClient) -> None:
    """The operator's threads share the client: the pool keeps a connection for each."""
    assert api.rest_client.pool_manager.connection_pool_kw["maxsize"] == CONNECTION_POOL_SIZE


@pytest.fixture
def default_configuration() -> Iterator[None]:
    """load_incluster_config() replaces the client's process-wide default; put it back."""
    saved = k8s.Configuration.get_default_copy()
    yield
    k8s.Configuration.set_default(saved)


@pytest.mark.usefixtures("default_configuration")
def test_in_a_cluster_the_service_account_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pod, the in-cluster credentials are used even when a kubeconfig is given."""
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("pod-token")
    (account / "ca.crt").write_text("not checked until a TLS handshake\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    from kubernetes.config import incluster_config

    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(account / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(account / "ca.crt"))
    api = connect(str(_kubeconfig(tmp_path / "config", "https://10.1.2.3:6443")))
    assert api.configuration.host == "https://10.96.0.1:443"
    assert_pool_holds_every_thread(api)
    # Bound service-account tokens rotate: the client re-reads the file.
    assert api.configuration.refresh_api_key_hook is not None
