"""Kubernetes discovery against a real API server (the control plane of e2e/controlplane):
EndpointSlices created, made unready, made ready and deleted, and the router following them
with real traffic."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from kubernetes import client as k8s

from fleetpilot.api.router_config import RouterTier
from fleetpilot.routing.discovery import KubernetesSource, KubeSliceClient
from fleetpilot.testing.controlplane import ControlPlane
from tests.routing.support import FakeEngine, engines, group, make_config, running_router

pytestmark = pytest.mark.cluster


def host_ip() -> str | None:
    """A non-loopback address of this machine: the API server refuses loopback endpoints."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))  # no packet is sent for a UDP connect
        except OSError:
            return None
        ip = str(s.getsockname()[0])
    return None if ip.startswith("127.") else ip


@pytest.fixture
def api(api_plane: ControlPlane) -> Iterator[k8s.ApiClient]:
    """A client of the session's real API server (tests/conftest.py)."""
    with api_plane.api_client() as client:
        yield client


def endpoint_slice(service: str, address: str, port: int, ready: bool) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-abcde",
            "labels": {
                "kubernetes.io/service-name": service,
                # Not the EndpointSlice controller's: it leaves slices it does not manage alone.
                "endpointslice.kubernetes.io/managed-by": "fleetpilot-test",
            },
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": "engine-0"},
            },
            {"addresses": ["10.99.0.9"], "conditions": {"ready": False}},
        ],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }


@pytest.mark.asyncio
async def test_router_follows_endpointslices_of_a_real_api_server(api: k8s.ApiClient) -> None:
    """Only the Ready endpoint of the Service's slice is routed to; marking it unready or
    deleting the slice takes it out (503), marking it ready brings it back."""
    ip = host_ip()
    if ip is None:
        pytest.skip("no non-loopback address on this machine")
    namespace = f"routing-{uuid.uuid4().hex[:6]}"
    # Typed Any: the generated client takes plain dict bodies, which its stubs do not allow.
    core: Any = k8s.CoreV1Api(api)
    discovery: Any = k8s.DiscoveryV1Api(api)
    core.create_namespace({"metadata": {"name": namespace}})
    engine = FakeEngine("k8s", host=ip)
    async with engines(engine):
        service = "chat-small"
        core.create_namespaced_service(
            namespace, {"metadata": {"name": service}, "spec": {"ports": [{"port": engine.port}]}}
        )
        discovery.create_namespaced_endpoint_slice(
            namespace, endpoint_slice(service, ip, engine.port, ready=True)
        )
        small = RouterTier(
            name="small",
            model="small-model",
            up_to=1.0,
            mode="unified",
            endpoints=[group([], service=service).model_copy(update={"port": engine.port})],
        )
        config = make_config([small], namespace=namespace)
        source = KubernetesSource(namespace, KubeSliceClient(api), watch_timeout_s=5)
        source.configure(config)
        async with running_router(config, source) as router, aiohttp.ClientSession() as http:

            async def status() -> int:
                body = {"model": "chat", "prompt": "hi"}
                async with http.post(router.url + "/v1/completions", json=body) as resp:
                    return resp.status

            async def settle(expected: list[str]) -> None:
                for _ in range(200):
                    if [r.id for r in router.state.router.replicas()] == expected:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"endpoints never became {expected}")

            await settle([engine.address])
            assert await status() == 200
            name = f"{service}-abcde"
            unready = endpoint_slice(service, ip, engine.port, ready=False)
            discovery.patch_namespaced_endpoint_slice(
                name, namespace, {"endpoints": unready["endpoints"]}
            )
            await settle([])
            assert await status() == 503
            ready = endpoint_slice(service, ip, engine.port, ready=True)
            discovery.patch_namespaced_endpoint_slice(
                name, namespace, {"endpoints": ready["endpoints"]}
            )
            await settle([engine.address])
            assert await status() == 200
            discovery.delete_namespaced_endpoint_slice(name, namespace)
            await settle([])
            assert await status() == 503
    core.delete_namespace(namespace)
