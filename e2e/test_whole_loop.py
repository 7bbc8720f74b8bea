"""The whole loop on Kubernetes (issue 42 part 3): the chart's operator, its router and CPU
reference engines all running as pods on process nodes (e2e/processnode), on the real control
plane.

`kubectl apply` of a two-tier service with `engine.backend: reference` (the shape of
examples/cpu-two-tier.yaml), a wait for its Ready condition as `kubectl wait` does, then the
official `openai` client talking to the router pod - at the address its Service's EndpointSlice
lists, as there is no kube-proxy here - getting answers from both tiers and prefix-cache hits.
Then an engine's process is killed: the node restarts it, and the router keeps answering and
takes the replica back.

The nodes of this module are untainted: the router has no placement fields, so while the module
runs every other node (the session's fake GPU nodes, which run nothing) is cordoned instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import openai
import pytest
import yaml
from kubernetes import client as k8s

from e2e.chart_support import Discovery, apply, release_name, render
from e2e.conftest import use_existing_cluster
from e2e.support import eventually
from fleetpilot.engine.vllm_args import ENGINE_PORT
from fleetpilot.kube import names
from fleetpilot.kube.client import Kube
from fleetpilot.operator.router_objects import ROUTER_METRICS_PORT, ROUTER_PORT
from fleetpilot.testing.cluster import Cluster
from fleetpilot.testing.processnode import ProcessNode, fleetpilot_image_table, skip_reason

pytestmark = pytest.mark.cluster

EXAMPLE = Path(__file__).parent.parent / "examples" / "cpu-two-tier.yaml"
SERVICE = "cpu"
LOOP_NODES = ("loop-node-0", "loop-node-1")
ISVC_API = "/apis/fleetpilot.dev/v1alpha1"


@dataclass
class Loop:
    """What the module's fixtures set up: the namespace, the service's router address, and
    the seconds from `kubectl apply` to the service's Ready condition."""

    namespace: str
    router: str
    ready_s: float


def cordon(core: k8s.CoreV1Api, nodes: list[str], unschedulable: bool) -> None:
    for node in nodes:
        core.patch_node(node, {"spec": {"unschedulable": unschedulable}})


@pytest.fixture(scope="module")
def loop_nodes(
    control_plane: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessNode]:
    """Two untainted process nodes, enough CPU for the operator, a router and the engines,
    the only schedulable nodes while the module runs."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    if use_existing_cluster():
        pytest.skip("the process node joins the test control plane, not an existing cluster")
    node = ProcessNode(
        control_plane.kubeconfig,
        tmp_path_factory.mktemp("loopnode"),
        LOOP_NODES,
        cpu="8",
        memory="32Gi",
        images=fleetpilot_image_table(),
        backoff_base_s=1.0,
        taints=(),
    )
    with control_plane.api_client() as api:
        core = k8s.CoreV1Api(api)
        others = [
            n.metadata.name
            for n in core.list_node().items
            if n.metadata.name not in LOOP_NODES and not n.spec.unschedulable
        ]
        cordon(core, others, True)
        try:
            node.start()
            try:
                yield node
            finally:
                try:
                    node.stop()
                finally:
                    node.delete_nodes(api)
        finally:
            cordon(core, [n for n in others if _exists(core, n)], False)


def _exists(core: k8s.CoreV1Api, node: str) -> bool:
    try:
        core.read_node(node)
    except k8s.ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def service_manifest(namespace: str) -> dict[str, Any]:
    """examples/cpu-two-tier.yaml in `namespace`, with two small-tier replicas at least, so a
    killed engine leaves a replica to answer."""
    obj: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"]["namespace"] = namespace
    obj["spec"]["tiers"][0]["serving"]["replicas"] = {"min": 2, "max": 2}
    return obj


def ready_condition(kube: Kube, namespace: str) -> dict[str, Any] | None:
    obj = kube.request("GET", f"{ISVC_API}/namespaces/{namespace}/inferenceservices/{SERVICE}")
    generation = obj["metadata"]["generation"]
    for c in obj.get("status", {}).get("conditions", []):
        # As `kubectl wait --for=condition=Ready`, and of this generation, not a stale one.
        fresh = c.get("observedGeneration", generation) == generation
        if c["type"] == "Ready" and c["status"] == "True" and fresh:
            return dict(c)
    return None


def router_address(discovery: k8s.DiscoveryV1Api, namespace: str) -> str | None:
    """The router pod's address from its Service's EndpointSlice: proof that the endpointslice
    controller saw the pod Ready (no kube-proxy here turns the ClusterIP into it)."""
    slices = discovery.list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={names.router_name(SERVICE)}"
    ).items
    ready = [
        a for s in slices for e in s.endpoints or [] if e.conditions.ready for a in e.addresses
    ]
    return ready[0] if ready else None


@pytest.fixture(scope="module")
def loop(
    loop_nodes: ProcessNode, control_plane: Cluster, chart: helm.Chart, chart_crds: None
) -> Iterator[Loop]:
    """The chart's operator installed (its non-hook objects, as `helm install`), then the
    service applied and waited for."""
    namespace = f"loop-{uuid.uuid4().hex[:8]}"
    with control_plane.api_client() as api:
        kube = Kube(api)
        core = k8s.CoreV1Api(api)
        core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=namespace)))
        release = release_name()
        objects = [
            o
            for o in render(chart, {"watchNamespaces": [namespace]}, release, namespace)
            if "helm.sh/hook" not in o["metadata"].get("annotations", {})
        ]
        paths = Discovery(kube)
        cluster_scoped = []
        try:
            for obj in objects:
                path = paths.path(obj)
                if path is None:
                    continue  # PodMonitor and the like: no such API here
                apply(kube, path, obj, dry_run=False)
                if "namespace" not in obj["metadata"]:
                    cluster_scoped.append(path)
            isvc = service_manifest(namespace)
            started = time.monotonic()
            apply(
                kube,
                f"{ISVC_API}/namespaces/{namespace}/inferenceservices/{SERVICE}",
                isvc,
                dry_run=False,
            )
            eventually(
                "the InferenceService Ready",
                lambda: ready_condition(kube, namespace),
                timeout=150,
            )
            ready_s = time.monotonic() - started
            discovery = k8s.DiscoveryV1Api(api)
            ip = eventually(
                "the router's EndpointSlice address", lambda: router_address(discovery, namespace)
            )
            print(f"\nwhole loop: apply -> Ready {ready_s:.1f}s")
            yield Loop(namespace, f"{ip}", ready_s)
        finally:
            # Absent when the apply failed: the namespace goes all the same.
            with contextlib.suppress(Exception):
                kube.request(
                    "DELETE", f"{ISVC_API}/namespaces/{namespace}/inferenceservices/{SERVICE}"
                )
            apps = k8s.AppsV1Api(api)
            apps.delete_collection_namespaced_deployment(namespace)
            core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
            core.delete_namespace(namespace)
            for path in cluster_scoped:
                kube.request("DELETE", path)


def client(loop: Loop) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{loop.router}:{ROUTER_PORT}/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
    )


def chat(api: openai.OpenAI, model: str, text: str) -> tuple[str, Any]:
    """One chat; the router's route header (its tier) and the usage."""
    raw = api.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=8
    )
    return raw.headers["x-fleetpilot-route"], raw.parse().usage


def route_tier(header: str) -> str:
    return dict(p.split("=", 1) for p in header.split("; "))["tier"]


def test_chats_through_the_router_pod_reach_both_tiers_with_prefix_hits(loop: Loop) -> None:
    """An easy chat is served by the small tier, one asking for the large tier's model by the
    large one; a long prompt repeated is served from the prefix cache the second time."""
    with client(loop) as api:
        chats_reach_both_tiers_with_prefix_hits(api)


def chats_reach_both_tiers_with_prefix_hits(api: openai.OpenAI) -> None:
    started = time.monotonic()
    header, usage = chat(api, "auto", "Hi!")
    first_s = time.monotonic() - started
    print(f"whole loop: first answer {first_s:.2f}s")
    assert route_tier(header) == "small"
    assert usage.completion_tokens > 0
    header, usage = chat(api, "large-model", "Hi!")
    assert route_tier(header) == "large"
    assert usage.completion_tokens > 0

    # The reference engines' tokenizer is bytes: about 900 tokens, within the small tier's 2048.
    long_prompt = " ".join(f"line {i} of a long shared document." for i in range(25))
    _, first = chat(api, "auto", long_prompt)
    header, second = chat(api, "auto", long_prompt)
    assert first.prompt_tokens == second.prompt_tokens
    cached = second.prompt_tokens_details.cached_tokens
    assert cached >= second.prompt_tokens // 2, (header, second)
    # The router predicted the hit from the engines' KV events: the prefix was in a replica.
    assert "prefix-match=0.00" not in header, header


def router_metrics(loop: Loop) -> str:
    url = f"http://{loop.router}:{ROUTER_METRICS_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def container_pid(pod: k8s.V1Pod) -> int:
    container_id = pod.status.container_statuses[0].container_id
    scheme, _, pid = container_id.partition("://")
    assert scheme == "process", container_id
    return int(pid)


def test_killed_engine_restarts_and_the_router_takes_it_back(
    loop: Loop, control_plane: Cluster, request: pytest.FixtureRequest
) -> None:
    """SIGKILL one of the small tier's two engines: its pod's restartCount grows, chats keep
    being answered by the other replica meanwhile, and the router counts both replicas active
    again once the engine is back (ejecting it in between, by its failures or its Ready)."""
    selector = ",".join(
        f"{k}={v}" for k, v in names.engine_selector(SERVICE, "small", "unified").items()
    )
    with control_plane.api_client() as api:
        core = k8s.CoreV1Api(api)
        pods = core.list_namespaced_pod(loop.namespace, label_selector=selector).items
        assert len(pods) == 2
        victim = pods[0]
        restarts = victim.status.container_statuses[0].restart_count
        api_client = client(loop)
        request.addfinalizer(api_client.close)
        before = router_metrics(loop)
        os.kill(container_pid(victim), signal.SIGKILL)
        killed = time.monotonic()

        failures = 0
        sent = 0
        saw_out = ""
        back_s = None
        restarted_s = None
        deadline = killed + 120
        while time.monotonic() < deadline:
            try:
                header, _ = chat(api_client, "auto", f"Hi {sent}!")
                assert route_tier(header) == "small"
            except (openai.APIError, httpx.HTTPError):
                failures += 1
            sent += 1
            text = router_metrics(loop)
            active = metric(text, "fleetpilot_router_endpoints", tier="small", state="active")
            ejected = metric(text, "fleetpilot_router_ejections_total", tier="small") > metric(
                before, "fleetpilot_router_ejections_total", tier="small"
            )
            if not saw_out and (active < 2 or ejected):
                saw_out = "ejected" if ejected else "left discovery"
            status = core.read_namespaced_pod(victim.metadata.name, loop.namespace).status
            if restarted_s is None and status.container_statuses[0].restart_count > restarts:
                restarted_s = time.monotonic() - killed
            if restarted_s is not None and saw_out and active == 2:
                back_s = time.monotonic() - killed
                break
            time.sleep(0.2)
        print(
            f"whole loop: killed engine restarted after {restarted_s}s, {saw_out}, back in "
            f"rotation after {back_s}s; {failures} of {sent} chats failed meanwhile"
        )
        assert restarted_s is not None, "the pod's restartCount did not grow"
        assert saw_out, "the router never took the killed replica out"
        assert back_s is not None, "the router did not take the replica back"
        assert failures == 0

        # Back means served: the new process's own counter (from 0) grows with chats that
        # the router spreads over both replicas again.
        ip = core.read_namespaced_pod(victim.metadata.name, loop.namespace).status.pod_ip

        def served() -> bool | None:
            chat(api_client, "auto", f"Hi again {uuid.uuid4().hex}!")
            with urllib.request.urlopen(f"http://{ip}:{ENGINE_PORT}/metrics", timeout=5) as r:
                text = r.read().decode()
            return True if metric(text, "vllm:request_success_total") > 0 else None

        eventually("a chat served by the restarted engine", served, timeout=30)
