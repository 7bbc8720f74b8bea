"""A real API server for the operator's tests that read what only a cluster has (its Nodes,
its Events): the control plane of e2e/controlplane, started once for the session, with the
InferenceService CRD installed. Skipped where its binaries are not built (run
e2e/controlplane/build.sh); the rest of tests/operator needs none of it."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleetpilot.api.crd import crd
from fleetpilot.kube.client import APPLY_CONTENT_TYPE, Kube
from fleetpilot.testing.controlplane import ControlPlane
from fleetpilot.testing.errors import ControlPlaneError
from fleetpilot.testing.polling import eventually

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def _install_crd(kube: Kube) -> None:
    """The generated InferenceService CRD, Established and in discovery."""
    definition = crd()
    name = definition["metadata"]["name"]
    kube.request(
        "PATCH",
        f"{CRD_PATH}/{name}",
        query=[("fieldManager", "tests"), ("force", "true")],
        body=definition,
        content_type=APPLY_CONTENT_TYPE,
    )

    def established() -> bool | None:
        conditions = kube.request("GET", f"{CRD_PATH}/{name}").get("status", {}).get("conditions")
        ok = any(
            c.get("type") == "Established" and c.get("status") == "True" for c in conditions or []
        )
        return True if ok else None

    eventually("InferenceService CRD Established", established)
    spec = definition["spec"]
    eventually(
        "InferenceService served",
        lambda: (
            kube.serves(f"{spec['group']}/{spec['versions'][0]['name']}", "inferenceservices")
            or None
        ),
    )


@pytest.fixture(scope="session")
def operator_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A real control plane with the InferenceService CRD, for the session."""
    plane = ControlPlane(Path(tmp_path_factory.mktemp("operator-cp")), build=False)
    try:
        plane.start()
    except ControlPlaneError as exc:
        pytest.skip(f"no control plane: {exc}")
    try:
        with plane.api_client() as api:
            _install_crd(Kube(api))
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def api_server(operator_plane: ControlPlane) -> Iterator[Kube]:
    """An admin client of the real API server (fleetpilot's own client, as the operator's)."""
    with operator_plane.api_client() as api:
        yield Kube(api)


@pytest.fixture
def impersonated(
    operator_plane: ControlPlane,
) -> Callable[[str], contextlib.AbstractContextManager[Kube]]:
    """``impersonated(user)``: a client acting as ``user`` (with no rights but RBAC's)."""

    @contextlib.contextmanager
    def client(user: str) -> Iterator[Kube]:
        with operator_plane.api_client() as api:
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
