"""The whole loop on Kubernetes (issue 42 part 3): the chart's operator, its router and CPU
reference engines all running as pods on process nodes (e2e/processnode), on the real control
plane.

`kubectl apply` of a two-tier service with `engine.backend: reference` (the shape of
examples/cpu-two-tier.yaml), a wait for its Ready condition as `kubectl wait` does, then the
official `openai` client talking to the router pod - at the address its Service's EndpointSlice
lists, as there is no kube-proxy here - getting answers from both tiers and prefix-cache hits.
Then an engine's process is killed: the node restarts it, and the router keeps answering and
takes the replica back. Then a load step: the operator's autoscaler reads the queue from a
Prometheus pod, scales the tier through /scale, and the new pod serves.

Prometheus is Debian's binary run as a pod (the image table maps an image to it). That build
lacks Kubernetes service discovery, so the test plays it (`ScrapeTargets`: annotated pods
written to a file_sd file in Prometheus' ConfigMap); the relabeling is the one documented in
fleetpilot.autoscaler.prometheus.

The nodes of this module are untainted: the router has no placement fields, so while the module
runs every other node (the session's fake GPU nodes, which run nothing) is cordoned instead.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import helm_python as helm
import httpx
import openai
import pytest
import urllib3
import yaml
from kubernetes import client as k8s

from e2e.chart_support import Discovery, apply, release_name, render
from e2e.conftest import use_existing_cluster
from e2e.support import pod_ready
from fleetpilot.engine.vllm_args import ENGINE_PORT
from fleetpilot.kube import names
from fleetpilot.kube.client import Kube
from fleetpilot.kube.managers import AUTOSCALER_MANAGER, owns_field
from fleetpilot.operator.router_objects import ROUTER_METRICS_PORT, ROUTER_PORT
from fleetpilot.testing.cluster import Cluster
from fleetpilot.testing.polling import eventually
from fleetpilot.testing.processnode import ProcessNode, fleetpilot_image_table, skip_reason

pytestmark = pytest.mark.cluster

EXAMPLE = Path(__file__).parent.parent / "examples" / "cpu-two-tier.yaml"
SERVICE = "cpu"
LOOP_NODES = ("loop-node-0", "loop-node-1")
ISVC_API = "/apis/fleetpilot.dev/v1alpha1"
FIGURES_ENV = "FLEETPILOT_WHOLE_LOOP_FIGURES"


@dataclass
class Loop:
    """What the module's fixtures set up: the namespace, the service's router address, and
    the seconds from `kubectl apply` to the service's Ready condition."""

    namespace: str
    router: str
    ready_s: float
    prometheus: str


def cordon(core: k8s.CoreV1Api, nodes: list[str], unschedulable: bool) -> None:
    for node in nodes:
        core.patch_node(node, {"spec": {"unschedulable": unschedulable}})


#: Prometheus runs as a pod too, from Debian's binary (`make prometheus`), as a cluster without
#: the Prometheus Operator runs it: scraping pods found through the API by their
#: prometheus.io annotations, which the operator sets on engine pods.
PROMETHEUS_IMAGE = "quay.io/prometheus/prometheus:v2.42.0"
PROMETHEUS_BINARY = Path("/usr/bin/prometheus")
#: The tests' fake Hub (tests/delivery/hub_server.py) run as a pod: a Hub mirror in the cluster.
HUB_IMAGE = "fleetpilot.test/fake-hub:1"
CHECKPOINT_REPO = "acme/reference-tiny"
CHECKPOINT_REVISION = "v1"


def image_table() -> dict[str, Any]:
    table = fleetpilot_image_table()
    table["images"].append(
        {
            "pattern": PROMETHEUS_IMAGE,
            "path": [str(PROMETHEUS_BINARY.parent)],
            "entrypoint": ["prometheus"],
            "env": {},
        }
    )
    table["images"].append(
        {
            "pattern": HUB_IMAGE,
            "path": [str(Path(sys.executable).parent)],
            "entrypoint": ["python", "-m", "tests.delivery.hub_server"],
            "env": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        }
    )
    return table


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
    if not os.access(PROMETHEUS_BINARY, os.X_OK):
        pytest.skip(f"no Prometheus at {PROMETHEUS_BINARY}: `make prometheus` installs it")
    node = ProcessNode(
        control_plane.kubeconfig,
        tmp_path_factory.mktemp("loopnode"),
        LOOP_NODES,
        cpu="16",
        memory="32Gi",
        images=image_table(),
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
            with node:
                yield node
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


def service_manifest(namespace: str, prometheus_url: str) -> dict[str, Any]:
    """examples/cpu-two-tier.yaml in `namespace`, read from `prometheus_url`, behind two
    routers, with two small-tier replicas at least (a killed engine leaves one to answer) and
    up to three, and two large-tier replicas; small ones run 2 sequences at once, so a short
    load step queues requests; the autoscaler decides every 2s on 1s scrapes, so the test
    waits seconds, not minutes."""
    obj: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"]["namespace"] = namespace
    small = obj["spec"]["tiers"][0]
    small["serving"]["replicas"] = {"min": 2, "max": 3}
    small["engine"]["maxNumSeqs"] = 2
    # A first-byte budget of 8 s (4 x the TTFT objective; the example's 500 ms gives the 2 s
    # floor): with two CPU hogs beside the suite, a tiny engine's first token can take over 2 s
    # while pods are replaced, which the router answers with a 504.
    small["autoscaling"].update({"interval": "2s", "window": "10s", "slo": {"ttftP95": "2s"}})
    large = obj["spec"]["tiers"][1]
    # Two, so a drained node never takes a whole tier: a budget of one unavailable lets a
    # one-replica tier's only pod go (the example's large tier has one).
    large["serving"]["replicas"] = {"min": 2, "max": 2}
    large["autoscaling"].update({"interval": "2s", "window": "10s"})
    obj["spec"]["monitoring"] = {"prometheusUrl": prometheus_url, "scrapeInterval": "1s"}
    # The chart's default: two routers, so a drained node never takes the only one.
    obj["spec"]["routing"]["replicas"] = 2
    return obj


def rolled_manifest(loop: Loop) -> dict[str, Any]:
    """The service as the rolling update leaves it: the large tier at maxNumSeqs 12 (16 in
    the example), so the tests after it change only what they mean to."""
    manifest = service_manifest(loop.namespace, loop.prometheus)
    manifest["spec"]["tiers"][1]["engine"]["maxNumSeqs"] = 12
    return manifest


class Poller:
    """A thread calling `poll()` every `period_s` seconds while the `with` block runs; an API
    call that fails is tried again at the next period."""

    period_s = 0.5

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def poll(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with contextlib.suppress(k8s.ApiException, urllib3.exceptions.HTTPError):
                self.poll()


class ScrapeTargets(Poller):
    """Plays Kubernetes pod discovery for Prometheus: every second, the namespace's running
    pods annotated prometheus.io/scrape, at podIP:prometheus.io/port, with their fleetpilot.dev
    labels as `labelmap` makes them and `namespace`, written to the ConfigMap's targets.json
    (which the node keeps up to date in the pod, as a kubelet does)."""

    period_s = 1.0

    def __init__(self, api: k8s.ApiClient, namespace: str) -> None:
        super().__init__()
        self.core = k8s.CoreV1Api(api)
        self.namespace = namespace
        self._written = "[]"

    def targets(self) -> list[dict[str, Any]]:
        found = []
        for pod in self.core.list_namespaced_pod(self.namespace).items:
            annotations = pod.metadata.annotations or {}
            if annotations.get("prometheus.io/scrape") != "true" or not pod.status.pod_ip:
                continue
            labels = {
                k.replace(".", "_").replace("/", "_").replace("-", "_"): v
                for k, v in (pod.metadata.labels or {}).items()
                if k.startswith("fleetpilot.dev/")
            }
            found.append({
                "targets": [f"{pod.status.pod_ip}:{annotations['prometheus.io/port']}"],
                "labels": {**labels, "namespace": self.namespace, "pod": pod.metadata.name},
            })  # fmt: skip
        return sorted(found, key=lambda t: str(t["targets"]))

    def poll(self) -> None:
        text = json.dumps(self.targets())
        if text != self._written:
            self.core.patch_namespaced_config_map(
                "prometheus", self.namespace, {"data": {"targets.json": text}}
            )
            self._written = text


def prometheus_objects(namespace: str) -> list[dict[str, Any]]:
    """Prometheus as a pod: its config and the pod. Debian's build lacks kubernetes_sd_configs,
    so it reads its targets from a file in its ConfigMap, which `ScrapeTargets` keeps to the
    namespace's annotated pods as Kubernetes discovery with the usual relabeling would (the
    pod labels as the autoscaler's reader expects them: see fleetpilot.autoscaler.prometheus)."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "fleetpilot-engines",
                "scrape_timeout": "1s",
                "file_sd_configs": [
                    {"files": ["/etc/prometheus/targets.json"], "refresh_interval": "1s"}
                ],
            }
        ],
    }
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "prometheus"},
         "data": {"prometheus.yml": yaml.safe_dump(config), "targets.json": "[]"}},
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "prometheus"},
            "spec": {
                "containers": [{
                    "name": "prometheus",
                    "image": PROMETHEUS_IMAGE,
                    "args": [
                        "--config.file=/etc/prometheus/prometheus.yml",
                        "--storage.tsdb.path=/prometheus",
                        "--web.listen-address=:9090",
                    ],
                    "ports": [{"name": "http", "containerPort": 9090}],
                    "readinessProbe": {"httpGet": {"path": "/-/ready", "port": "http"},
                                       "periodSeconds": 1},
                    "volumeMounts": [
                        {"name": "config", "mountPath": "/etc/prometheus"},
                        {"name": "data", "mountPath": "/prometheus"},
                    ],
                }],
                "volumes": [
                    {"name": "config", "configMap": {"name": "prometheus"}},
                    {"name": "data", "emptyDir": {}},
                ],
            },
        },
    ]  # fmt: skip


def ready_of(service: dict[str, Any]) -> dict[str, Any] | None:
    """The service's Ready condition when True and of its current generation (as `kubectl
    wait --for=condition=Ready` takes it, never a stale one), else None."""
    generation = service["metadata"]["generation"]
    for c in service.get("status", {}).get("conditions", []):
        fresh = c.get("observedGeneration", generation) == generation
        if c["type"] == "Ready" and c["status"] == "True" and fresh:
            return dict(c)
    return None


def ready_condition(kube: Kube, namespace: str, service: str = SERVICE) -> dict[str, Any] | None:
    return ready_of(
        kube.request("GET", f"{ISVC_API}/namespaces/{namespace}/inferenceservices/{service}")
    )


def ready_routers(
    discovery: k8s.DiscoveryV1Api, namespace: str, service: str = SERVICE
) -> list[str]:
    """The router pods' addresses from their Service's EndpointSlices, where the endpointslice
    controller lists them ready (no kube-proxy here turns the ClusterIP into them)."""
    slices = discovery.list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={names.router_name(service)}"
    ).items
    return sorted(
        a for s in slices for e in s.endpoints or [] if e.conditions.ready for a in e.addresses
    )


def router_address(
    discovery: k8s.DiscoveryV1Api, namespace: str, service: str = SERVICE
) -> str | None:
    ready = ready_routers(discovery, namespace, service)
    return ready[0] if ready else None


@pytest.fixture(scope="module")
def figures() -> Iterator[dict[str, Any]]:
    """The module's measured figures, by test; written as JSON to the file named by
    $FLEETPILOT_WHOLE_LOOP_FIGURES when set (bench/whole_loop.py reads them from there)."""
    found: dict[str, Any] = {}
    yield found
    path = os.environ.get(FIGURES_ENV)
    if path:
        Path(path).write_text(json.dumps(found, indent=2) + "\n")


@pytest.fixture(scope="module")
def loop(
    loop_nodes: ProcessNode,
    control_plane: Cluster,
    chart: helm.Chart,
    chart_crds: None,
    figures: dict[str, Any],
) -> Iterator[Loop]:
    """Prometheus as a pod, the chart's operator installed (its non-hook objects, as `helm
    install`), then the service applied, read from that Prometheus, and waited for."""
    namespace = f"loop-{uuid.uuid4().hex[:8]}"
    with control_plane.api_client() as api, contextlib.ExitStack() as stack:
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
            for obj in prometheus_objects(namespace):
                path = paths.path({**obj, "metadata": {**obj["metadata"], "namespace": namespace}})
                assert path is not None
                apply(kube, path, obj, dry_run=False)

            def prometheus_ip() -> str | None:
                pod = core.read_namespaced_pod("prometheus", namespace)
                return str(pod.status.pod_ip) if pod_ready(pod) else None

            try:
                prometheus = f"http://{eventually('Prometheus Ready', prometheus_ip)}:9090"
            except AssertionError as e:
                pod = core.read_namespaced_pod("prometheus", namespace)
                logs = core.read_namespaced_pod_log("prometheus", namespace, tail_lines=20)
                raise AssertionError(f"{e}\n{pod.status}\n{logs}") from None
            stack.enter_context(ScrapeTargets(api, namespace))
            for obj in objects:
                path = paths.path(obj)
                if path is None:
                    continue  # PodMonitor and the like: no such API here
                apply(kube, path, obj, dry_run=False)
                if "namespace" not in obj["metadata"]:
                    cluster_scoped.append(path)
            isvc = service_manifest(namespace, prometheus)
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
            figures["apply_to_ready_s"] = round(ready_s, 1)
            yield Loop(namespace, f"{ip}", ready_s, prometheus)
        finally:
            stack.close()  # stops ScrapeTargets before its ConfigMap goes
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


def client_at(address: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{address}:{ROUTER_PORT}/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
    )


def client(loop: Loop) -> openai.OpenAI:
    return client_at(loop.router)


class SteadyChats:
    """`workers` clients chatting without pause while the block runs, worker i with
    `models[i % len(models)]` at the router address `address()` gives for each chat; each
    answer's route must name `tier` when given. What was served and what failed is kept."""

    def __init__(
        self,
        workers: int,
        address: Callable[[], str],
        models: Sequence[str],
        *,
        tier: str | None = None,
        max_tokens: int = 8,
    ) -> None:
        self.address = address
        self.models = models
        self.tier = tier
        self.max_tokens = max_tokens
        self.served: list[int] = []
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._chat, args=(i,)) for i in range(workers)]

    def __enter__(self) -> SteadyChats:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _chat(self, worker: int) -> None:
        model = self.models[worker % len(self.models)]
        clients: dict[str, openai.OpenAI] = {}
        n = 0
        try:
            while not self._stop.is_set():
                n += 1
                address = self.address()
                api = clients.get(address) or clients.setdefault(address, client_at(address))
                try:
                    raw = api.chat.completions.with_raw_response.create(
                        model=model,
                        messages=[{"role": "user", "content": f"Worker {worker} asks {n}."}],
                        max_tokens=self.max_tokens,
                    )
                    header = raw.headers["x-fleetpilot-route"]
                    assert self.tier is None or route_tier(header) == self.tier, header
                    self.served.append(worker)
                except (openai.APIError, httpx.HTTPError) as e:
                    self.failures.append(e)
        finally:
            for api in clients.values():
                api.close()


class RouterAddresses(Poller):
    """What kube-proxy would do for the router Service, which has no kube-proxy here: the
    ready addresses of its EndpointSlices, refreshed twice a second, taken in turn."""

    def __init__(self, api: k8s.ApiClient, namespace: str) -> None:
        super().__init__()
        self.discovery = k8s.DiscoveryV1Api(api)
        self.namespace = namespace
        self._ready: list[str] = []
        self._turn = itertools.count()

    def __enter__(self) -> Self:
        self.poll()
        return super().__enter__()

    def poll(self) -> None:
        self._ready = ready_routers(self.discovery, self.namespace)

    def pick(self) -> str:
        ready = eventually("a ready router address", lambda: self._ready or None, timeout=30)
        return ready[next(self._turn) % len(ready)]


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
    loop: Loop, control_plane: Cluster, request: pytest.FixtureRequest, figures: dict[str, Any]
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
        figures["killed_engine"] = {
            "restarted_s": restarted_s and round(restarted_s, 1),
            "back_in_rotation_s": back_s and round(back_s, 1),
            "failed": failures,
            "sent": sent,
        }
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


def engine_served(ip: str) -> float:
    """The engine's successful requests, from its own /metrics (0 for a fresh process)."""
    with urllib.request.urlopen(f"http://{ip}:{ENGINE_PORT}/metrics", timeout=5) as response:
        return metric(response.read().decode(), "vllm:request_success_total")


def test_load_step_scales_up_through_prometheus_and_the_new_pod_serves(
    loop: Loop, control_plane: Cluster, figures: dict[str, Any]
) -> None:
    """A load step on the small tier (twelve chats at a time against two engines running two
    each) queues requests; the operator's autoscaler reads that from the Prometheus pod and
    scales the tier's Deployment through /scale; the new pod turns Ready, enters the router's
    EndpointSlice discovery and serves. Measured: the decision to the first served request."""
    deployment = names.engine_name(SERVICE, "small", "unified")
    selector = ",".join(
        f"{k}={v}" for k, v in names.engine_selector(SERVICE, "small", "unified").items()
    )
    with control_plane.api_client() as api:
        apps, core = k8s.AppsV1Api(api), k8s.CoreV1Api(api)
        before = {
            p.metadata.name
            for p in core.list_namespaced_pod(loop.namespace, label_selector=selector).items
        }
        assert apps.read_namespaced_deployment(deployment, loop.namespace).spec.replicas == 2
        started = time.monotonic()
        with SteadyChats(12, lambda: loop.router, ["small-model"], max_tokens=64) as chats:

            def scaled() -> float | None:
                spec = apps.read_namespaced_deployment(deployment, loop.namespace).spec
                return time.monotonic() if spec.replicas == 3 else None

            decided = eventually("the autoscaler's scale-up to 3", scaled, timeout=90)

            def new_ready_pod_ip() -> str | None:
                pods = core.list_namespaced_pod(loop.namespace, label_selector=selector).items
                fresh = [p for p in pods if p.metadata.name not in before and pod_ready(p)]
                return str(fresh[0].status.pod_ip) if fresh else None

            ip = eventually("the new pod Ready", new_ready_pod_ip, timeout=60)
            ready_at = time.monotonic()
            served_at = eventually(
                "a request served by the new pod",
                lambda: time.monotonic() if engine_served(ip) > 0 else None,
                timeout=60,
            )
        # The autoscaler wrote it, through /scale, and said why in an Event on the service.
        live = api.sanitize_for_serialization(
            apps.read_namespaced_deployment(deployment, loop.namespace)
        )
        assert owns_field(live, AUTOSCALER_MANAGER, ("spec", "replicas"))
        events = core.list_namespaced_event(
            loop.namespace, field_selector=f"involvedObject.name={SERVICE},reason=ScaledUp"
        ).items
        assert events, "no ScaledUp Event on the InferenceService"
        print(f"whole loop: {events[0].message}")
    print(
        f"whole loop: load step -> scale-up decision {decided - started:.1f}s, decision -> "
        f"new pod Ready {ready_at - decided:.1f}s, -> first request served by the new pod "
        f"{served_at - decided:.1f}s; "
        f"{len(chats.failures)} chats failed"
    )
    figures["load_step"] = {
        "decision_s": round(decided - started, 1),
        "decision_to_ready_s": round(ready_at - decided, 1),
        "decision_to_served_s": round(served_at - decided, 1),
        "failed": len(chats.failures),
    }
    assert chats.failures == []


def test_a_rolling_update_under_steady_load_fails_no_request(
    loop: Loop, control_plane: Cluster, figures: dict[str, Any]
) -> None:
    """A changed engine setting on the large tier (maxNumSeqs 16 -> 12: a new pod template)
    rolls its Deployment (maxSurge 1, maxUnavailable 0) while four clients chat with it without
    pause: the new pod starts, turns Ready and joins the router's EndpointSlice discovery; the
    old one leaves it and drains what it holds. Measured: the requests that failed (goal 0)
    and the seconds from the apply to the rollout's end."""
    deployment = names.engine_name(SERVICE, "large", "unified")
    selector = ",".join(
        f"{k}={v}" for k, v in names.engine_selector(SERVICE, "large", "unified").items()
    )
    with control_plane.api_client() as api:
        kube = Kube(api)
        apps, core = k8s.AppsV1Api(api), k8s.CoreV1Api(api)
        old = {
            p.metadata.name
            for p in core.list_namespaced_pod(loop.namespace, label_selector=selector).items
        }
        assert old
        with SteadyChats(4, lambda: loop.router, ["large-model"], tier="large") as chats:
            time.sleep(2.0)  # the load is steady before the change
            manifest = rolled_manifest(loop)
            started = time.monotonic()
            apply(
                kube,
                f"{ISVC_API}/namespaces/{loop.namespace}/inferenceservices/{SERVICE}",
                manifest,
                dry_run=False,
            )

            def rolled() -> float | None:
                live = apps.read_namespaced_deployment(deployment, loop.namespace)
                status, wanted = live.status, live.spec.replicas
                pods = core.list_namespaced_pod(loop.namespace, label_selector=selector).items
                done = (
                    (status.observed_generation or 0) >= live.metadata.generation
                    and status.updated_replicas == wanted
                    and status.ready_replicas == wanted
                    and status.replicas == wanted
                    and not {p.metadata.name for p in pods} & old
                )
                return time.monotonic() if done else None

            finished = eventually("the large tier's rollout", rolled, timeout=150)
            served_at_end = len(chats.served)
            time.sleep(2.0)  # and stays served after it
    print(
        f"whole loop: rolling update of the large tier under 4 clients: rollout "
        f"{finished - started:.1f}s, {len(chats.served)} chats served, "
        f"{len(chats.failures)} failed"
    )
    figures["rolling_update"] = {
        "rollout_s": round(finished - started, 1),
        "served": len(chats.served),
        "failed": len(chats.failures),
    }
    assert chats.failures == [], chats.failures[:3]
    assert len(chats.served) > served_at_end > 0


def evict(core: k8s.CoreV1Api, pod: k8s.V1Pod, deadline: float) -> int:
    """Evict `pod` as `kubectl drain` does: through the Eviction API, again every second while
    a disruption budget refuses it (429). Returns how many times it was refused."""
    name, namespace = pod.metadata.name, pod.metadata.namespace
    body = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name=name, namespace=namespace))
    refused = 0
    while True:
        try:
            core.create_namespaced_pod_eviction(name, namespace, body)
            return refused
        except k8s.ApiException as e:
            if e.status == 404:
                return refused
            if e.status != 429 or time.monotonic() > deadline:
                raise
            refused += 1
            time.sleep(1.0)


class BudgetWatch(Poller):
    """Samples, twice a second while the block runs, every disruption budget of the namespace
    (its healthy pods against the ones it needs) and the service's Ready condition."""

    def __init__(self, api: k8s.ApiClient, namespace: str) -> None:
        super().__init__()
        self.policy = k8s.PolicyV1Api(api)
        self.kube = Kube(api)
        self.namespace = namespace
        self.breaches: list[str] = []
        self.not_ready: list[str] = []
        self.samples = 0

    def poll(self) -> None:
        budgets = self.policy.list_namespaced_pod_disruption_budget(self.namespace)
        for pdb in budgets.items:
            status = pdb.status
            if status and (status.current_healthy or 0) < (status.desired_healthy or 0):
                self.breaches.append(
                    f"{pdb.metadata.name}: {status.current_healthy} healthy < "
                    f"{status.desired_healthy}"
                )
        service = self.kube.request(
            "GET", f"{ISVC_API}/namespaces/{self.namespace}/inferenceservices/{SERVICE}"
        )
        if ready_of(service) is None:
            said = [
                f"{c.get('status')} {c.get('reason')}: {c.get('message')} "
                f"(gen {c.get('observedGeneration')} of {service['metadata']['generation']})"
                for c in service.get("status", {}).get("conditions", [])
                if c["type"] == "Ready"
            ]
            self.not_ready.append(f"{time.monotonic():.1f} {said}")
        self.samples += 1


def evict_all(
    api: k8s.ApiClient, pods: list[k8s.V1Pod], timeout: float = 150.0
) -> tuple[int, float]:
    """Evict `pods` at once, each retried while a budget refuses it (as `kubectl drain`), and
    wait until none of them is left and every Deployment of their namespace has all its
    replicas ready again. The refusals, and the seconds it took."""
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    namespace = pods[0].metadata.namespace
    started = time.monotonic()
    with ThreadPoolExecutor(len(pods)) as pool:
        refusals = sum(pool.map(lambda p: evict(core, p, started + timeout), pods))
    evicted = {p.metadata.uid for p in pods}

    def replaced() -> float | None:
        if evicted & {p.metadata.uid for p in core.list_namespaced_pod(namespace).items}:
            return None
        for d in apps.list_namespaced_deployment(namespace).items:
            if d.status is None or (d.status.ready_replicas or 0) < d.spec.replicas:
                return None
        return time.monotonic()

    finished = eventually("the evicted pods replaced and ready", replaced, timeout=timeout)
    return refusals, finished - started


def test_a_node_drain_keeps_the_disruption_budgets_and_the_service(
    loop: Loop, control_plane: Cluster, figures: dict[str, Any]
) -> None:
    """`kubectl drain` of a node while four clients chat with both tiers through the router
    Service (its ready EndpointSlice addresses, as kube-proxy would): the node is cordoned,
    every pod a controller owns there is evicted through the Eviction API (retried while a
    budget refuses), its replacement lands on the other node. Then every engine of the small
    tier evicted at once, which its budget (one unavailable at a time) must spread out. All
    along every disruption budget keeps the healthy pods it needs, the service stays Ready,
    and no chat fails. Measured: the refusals, the seconds, failed chats."""
    selector = ",".join(
        f"{k}={v}" for k, v in names.engine_selector(SERVICE, "small", "unified").items()
    )
    with control_plane.api_client() as api:
        core = k8s.CoreV1Api(api)

        def owned_pods(node: str) -> list[k8s.V1Pod]:
            return [
                p
                for p in core.list_namespaced_pod(
                    loop.namespace, field_selector=f"spec.nodeName={node}"
                ).items
                if p.metadata.owner_references and not p.metadata.deletion_timestamp
            ]

        def of_service(pod: k8s.V1Pod) -> bool:
            """A router or engine pod (the only other pod a controller owns: the operator)."""
            return names.LABEL_SERVICE in (pod.metadata.labels or {})

        def operator_on(node: str) -> bool:
            return not all(of_service(p) for p in owned_pods(node))

        # The node without the operator, if it holds any of the service: its status is then
        # written throughout, so the Ready samples are the operator's word, not a stale one.
        node = max(
            LOOP_NODES,
            key=lambda n: (any(of_service(p) for p in owned_pods(n)), not operator_on(n)),
        )
        victims = owned_pods(node)
        assert victims, f"no pods on {node}"
        print(f"whole loop: draining {node}: {sorted(p.metadata.name for p in victims)}")
        with (
            RouterAddresses(api, loop.namespace) as routers,
            SteadyChats(4, routers.pick, ["small-model", "large-model"]) as chats,
            BudgetWatch(api, loop.namespace) as watch,
        ):
            time.sleep(2.0)  # the load is steady before the drain
            cordon(core, [node], True)
            try:
                refusals, drain_s = evict_all(api, victims)
                assert not owned_pods(node)
            finally:
                cordon(core, [node], False)
            small = core.list_namespaced_pod(loop.namespace, label_selector=selector).items
            tier_refusals, tier_s = evict_all(api, small)
            time.sleep(2.0)  # and the service stays served after it
    print(
        f"whole loop: drain of {node} ({len(victims)} pods): {refusals} evictions refused by "
        f"a budget, all back in {drain_s:.1f}s; the small tier's {len(small)} engines evicted "
        f"at once: {tier_refusals} refused, back in {tier_s:.1f}s; {len(chats.served)} chats "
        f"served, {len(chats.failures)} failed; {len(watch.not_ready)} of {watch.samples} "
        "samples not Ready"
    )
    figures["drain"] = {
        "pods": len(victims),
        "evictions_refused": refusals,
        "drain_s": round(drain_s, 1),
        "tier_pods": len(small),
        "tier_evictions_refused": tier_refusals,
        "tier_s": round(tier_s, 1),
        "served": len(chats.served),
        "failed": len(chats.failures),
    }
    assert watch.samples > 0
    assert watch.breaches == [], watch.breaches[:3]
    assert tier_refusals > 0, "the budget let every engine of the tier go at once"
    assert watch.not_ready == [], watch.not_ready[:5]
    assert chats.failures == [], [f"{type(e).__name__}: {e}" for e in chats.failures]
    assert len(chats.served) > 0


def test_a_tier_scales_to_zero_and_a_held_request_brings_it_back(
    loop: Loop, control_plane: Cluster, figures: dict[str, Any]
) -> None:
    """The large tier allowed to go to zero (replicas.min 0, a 4 s scale-down window): idle,
    the autoscaler scales it to zero and its pods go. Then one streamed chat for it: the router
    holds it, Prometheus sees it held (the router's pending requests), the autoscaler scales
    the tier from zero, the pod starts, turns Ready and joins the router's discovery, and the
    held chat is answered. Measured: its time to first token. The tier is given back its
    two replicas at the end."""
    deployment = names.engine_name(SERVICE, "large", "unified")
    selector = ",".join(
        f"{k}={v}" for k, v in names.engine_selector(SERVICE, "large", "unified").items()
    )
    path = f"{ISVC_API}/namespaces/{loop.namespace}/inferenceservices/{SERVICE}"
    with control_plane.api_client() as api:
        kube = Kube(api)
        apps, core = k8s.AppsV1Api(api), k8s.CoreV1Api(api)
        manifest = rolled_manifest(loop)
        large = manifest["spec"]["tiers"][1]
        large["serving"]["replicas"] = {"min": 0, "max": 1}
        large["autoscaling"]["scaleDown"] = {"stabilization": "4s"}
        started = time.monotonic()
        apply(kube, path, manifest, dry_run=False)
        try:

            def at_zero() -> float | None:
                spec = apps.read_namespaced_deployment(deployment, loop.namespace).spec
                pods = core.list_namespaced_pod(loop.namespace, label_selector=selector).items
                return time.monotonic() if spec.replicas == 0 and not pods else None

            zero_at = eventually("the large tier at zero", at_zero, timeout=120)
            print(f"whole loop: large tier idle -> zero pods in {zero_at - started:.1f}s")
            with RouterAddresses(api, loop.namespace) as routers:
                api_client = client_at(routers.pick())
                sent = time.monotonic()
                first_token = None
                text = ""
                raw = api_client.chat.completions.with_raw_response.create(
                    model="large-model",
                    messages=[{"role": "user", "content": "Anyone there?"}],
                    max_tokens=8,
                    stream=True,
                )
                header = raw.headers["x-fleetpilot-route"]
                for chunk in raw.parse():
                    delta = chunk.choices[0].delta.content if chunk.choices else None
                    if delta and first_token is None:
                        first_token = time.monotonic()
                    text += delta or ""
                done = time.monotonic()
                api_client.close()
            assert route_tier(header) == "large", header
            assert first_token is not None, "the held chat got no tokens"
            assert text
            assert apps.read_namespaced_deployment(deployment, loop.namespace).spec.replicas == 1
            events = core.list_namespaced_event(
                loop.namespace, field_selector=f"involvedObject.name={SERVICE},reason=ScaledUp"
            ).items
            from_zero = [e.message for e in events if "no replicas" in (e.message or "")]
            assert from_zero, [e.message for e in events]
            print(f"whole loop: {from_zero[-1]}")
        finally:
            apply(kube, path, rolled_manifest(loop), dry_run=False)

        def serving_again() -> bool | None:
            pods = core.list_namespaced_pod(loop.namespace, label_selector=selector).items
            return True if sum(pod_ready(p) for p in pods) >= 2 else None

        eventually("the large tier back at its two replicas", serving_again, timeout=120)
    print(
        f"whole loop: held chat for the large tier at zero: first token after "
        f"{first_token - sent:.1f}s, done after {done - sent:.1f}s"
    )
    figures["scale_from_zero"] = {
        "idle_to_zero_s": round(zero_at - started, 1),
        "held_ttft_s": round(first_token - sent, 1),
        "held_total_s": round(done - sent, 1),
    }


def hub_objects(checkpoint: Path) -> list[dict[str, Any]]:
    """The tests' fake Hub (tests/delivery/hub_server.py) as a pod: a Hub mirror inside the
    cluster serving `checkpoint` (a host folder) as CHECKPOINT_REPO, reached at its pod IP."""
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "fake-hub"},
            "spec": {
                "containers": [{
                    "name": "hub",
                    "image": HUB_IMAGE,
                    "args": ["--repo", CHECKPOINT_REPO, "--revision", CHECKPOINT_REVISION,
                             "--dir", "/repo", "--host", "0.0.0.0", "--advertise", "$(POD_IP)",
                             "--port", "8080", "--cdn-port", "8081"],
                    "env": [{"name": "POD_IP",
                             "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                    "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                    "volumeMounts": [{"name": "repo", "mountPath": "/repo", "readOnly": True}],
                }],
                "volumes": [{"name": "repo", "hostPath": {"path": str(checkpoint)}}],
            },
        }
    ]  # fmt: skip


def checkpoint_manifest(namespace: str, hub: str) -> dict[str, Any]:
    """One reference tier serving CHECKPOINT_REPO from the Hub at `hub`, downloaded once into
    the service's model cache (the claim `model-cache`) by the operator's Job."""
    return {
        "apiVersion": "fleetpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "ckpt", "namespace": namespace},
        "spec": {
            "modelCache": {"claimName": "model-cache"},
            "tiers": [{
                "name": "small",
                "engine": {"backend": "reference", "maxNumSeqs": 4},
                "model": {
                    "name": CHECKPOINT_REPO,
                    "servedName": "checkpoint-model",
                    "source": {"huggingface": {"revision": CHECKPOINT_REVISION,
                                               "endpoint": hub}},
                },
                "serving": {"replicas": {"min": 1, "max": 1}},
            }],
            "routing": {"replicas": 1},
        },
    }  # fmt: skip


def test_a_model_download_job_fills_the_cache_before_the_engine_starts(
    loop: Loop,
    loop_nodes: ProcessNode,
    control_plane: Cluster,
    tmp_path: Path,
    figures: dict[str, Any],
) -> None:
    """A second service whose reference tier reads a checkpoint (written by the reference
    engine's own save_checkpoint) from a Hub running as a pod, through a model cache: the
    operator's download Job fetches it into the cache claim, the engine Deployment is not
    created until the Job has completed, then the engine reads the cache offline and serves
    chats through the service's router. Measured: apply to the Job's end, to Ready."""
    from fleetpilot.engine.reference.checkpoint import save_checkpoint
    from fleetpilot.engine.reference.model import LlamaModel
    from fleetpilot.engine.reference.settings import MODEL_PRESETS

    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(LlamaModel(MODEL_PRESETS["tiny"]), checkpoint)
    path = f"{ISVC_API}/namespaces/{loop.namespace}/inferenceservices/ckpt"
    with control_plane.api_client() as api:
        kube, core = Kube(api), k8s.CoreV1Api(api)
        apps, batch = k8s.AppsV1Api(api), k8s.BatchV1Api(api)
        discovery, paths = k8s.DiscoveryV1Api(api), Discovery(kube)
        for obj in hub_objects(checkpoint):
            obj["metadata"]["namespace"] = loop.namespace
            apply(kube, paths.path(obj) or "", obj, dry_run=False)
        try:

            def hub_ip() -> str | None:
                pod = core.read_namespaced_pod("fake-hub", loop.namespace)
                return str(pod.status.pod_ip) if pod_ready(pod) else None

            hub = f"http://{eventually('the fake Hub Ready', hub_ip)}:8080"
            loop_nodes.bind_claim(api, loop.namespace, "model-cache")
            started = time.monotonic()
            apply(kube, path, checkpoint_manifest(loop.namespace, hub), dry_run=False)
            engine = names.engine_name("ckpt", "small", "unified")
            fetch_selector = f"{names.LABEL_SERVICE}=ckpt,{names.LABEL_COMPONENT}=model-fetch"

            def job_done() -> float | None:
                jobs = batch.list_namespaced_job(loop.namespace, label_selector=fetch_selector)
                engines = apps.list_namespaced_deployment(
                    loop.namespace, field_selector=f"metadata.name={engine}"
                ).items
                complete = [j for j in jobs.items if (j.status.succeeded or 0) > 0]
                # Until the download is complete, no engine is planned to read it.
                assert complete or not engines, "the engine Deployment came before the Job"
                assert not [j for j in jobs.items if (j.status.failed or 0) > 0], jobs
                return time.monotonic() if complete else None

            downloaded = eventually("the download Job's success", job_done, timeout=120)
            eventually(
                "the checkpoint service Ready",
                lambda: ready_condition(kube, loop.namespace, "ckpt"),
                timeout=120,
            )
            ready = time.monotonic()
            router = eventually(
                "its router's address", lambda: router_address(discovery, loop.namespace, "ckpt")
            )
            with client_at(router) as api_client:
                header, usage = chat(api_client, "checkpoint-model", "Hello, checkpoint!")
            assert route_tier(header) == "small"
            assert usage.completion_tokens > 0
            hub_log = core.read_namespaced_pod_log("fake-hub", loop.namespace)
            assert "cdn GET model.safetensors" in hub_log, hub_log
        finally:
            with contextlib.suppress(Exception):
                kube.request("DELETE", path)
            core.delete_namespaced_pod("fake-hub", loop.namespace, grace_period_seconds=0)
    print(
        f"whole loop: checkpoint service: apply -> download Job complete "
        f"{downloaded - started:.1f}s -> Ready {ready - started:.1f}s"
    )
    figures["model_download"] = {
        "apply_to_job_complete_s": round(downloaded - started, 1),
        "apply_to_ready_s": round(ready - started, 1),
    }
