"""Clients and namespaces on the real API server (tests/conftest.py's ``api_plane``) for the
operator's tests that read what only a cluster has (its Nodes, its Events)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator

import pytest

from fleetpilot.kube.client import Kube
from fleetpilot.testing.controlplane import ControlPlane


@pytest.fixture(scope="session")
def api_server(api_plane: ControlPlane) -> Iterator[Kube]:
    """An admin client of the real API server (fleetpilot's own client, as the operator's)."""
    with api_plane.api_client() as api:
        yield Kube(api)


@pytest.fixture
def impersonated(
    api_plane: ControlPlane,
) -> Callable[[str], contextlib.AbstractContextManager[Kube]]:
    """``impersonated(user)``: a client acting as ``user`` (with no rights but RBAC's)."""

    @contextlib.contextmanager
    def client(user: str) -> Iterator[Kube]:
        with api_plane.api_client() as api:
            api.set_default_header("Impersonate-User", user)
            yield Kube(api)

    return client


@pytest.fixture
def namespace(api_server: Kube) -> Iterator[str]:
    """A fresh namespace per test. Deleted after with what runs in it: without a kubelet a
    bound pod's graceful deletion never ends, so workloads go first, then pods at once."""
    name = f"op-{uuid.uuid4().hex[:8]}"
    api_server.request("POST", "/api/v1/namespaces", body={"metadata": {"name": name}})
    yield name
    for path in (
        f"/apis/apps/v1/namespaces/{name}/deployments",
        f"/apis/apps/v1/namespaces/{name}/replicasets",
    ):
        api_server.request("DELETE", path)
    api_server.request(
        "DELETE", f"/api/v1/namespaces/{name}/pods", query=[("gracePeriodSeconds", "0")]
    )
    api_server.request("DELETE", f"/api/v1/namespaces/{name}")
