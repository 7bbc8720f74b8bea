"""Fixtures for every test under tests/. A real API server for the tests that read what only a
cluster has (its Nodes, its Events, its EndpointSlices): the control plane of e2e/controlplane,
started once for the session by the first test that asks (tests/operator's, the router's
discovery), with the InferenceService CRD installed. Skipped where its binaries are not built
(run e2e/controlplane/build.sh); the rest of tests/ needs none of it. e2e/ starts its own."""

from __future__ import annotations

from collections.abc import Iterator
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
def api_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A real control plane with the InferenceService CRD, shared by the session's tests."""
    plane = ControlPlane(Path(tmp_path_factory.mktemp("tests-cp")), build=False)
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
