"""GIE's own endpoint picker behind the Go gateway: the Gateway API Inference Extension's full
EPP at v1.3.0 (built from its module by e2e/gie-epp/build.sh, not a double), in its standalone
mode against the test control plane's API server, finding its model-server pods by label; the
Go gateway (e2e/gateway) in front of it playing Envoy's side of ext_proc; real engines behind.

What this proves is the gateway's faithfulness, so that fleetpilot's picker behind the same
gateway (e2e/test_gateway.py) is judged on the protocol GIE's gateways speak: GIE's picks reach
the engines it picked (its header and its ``envoy.lb`` metadata agree, or the gateway refuses),
its request and response bodies pass through in both directions, whole and streamed, and its
refusals reach the client as GIE writes them. And a few of GIE's own hermetic expectations
(test/integration/epp/hermetic_test.go in the v1.3.0 module), there asserted on the ext_proc
messages with a fake metrics client, hold here end to end: engines report the queue and KV
figures of GIE's cases on their vLLM ``/metrics``, GIE scrapes them, and the request lands where
GIE's scorers send it.

No kubelet runs here: the pods are API objects bound to a tainted node of their own, their
status (Ready, a pod IP) written by the test as a kubelet would. Their IPs are loopback
addresses (Linux routes all of 127/8 to lo), each with an engine listening on the pool's target
port: two reference engines (real vLLM-compatible servers) for the chats, engine doubles whose
reported metrics the test sets for GIE's scoring cases.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from aiohttp import web
from kubernetes import client as k8s

from fleetpilot.kube.client import Kube
from fleetpilot.runtime.processes import free_port, port_in_use
from fleetpilot.testing.cluster import Cluster
from fleetpilot.testing.gateway import Gateway
from fleetpilot.testing.gateway import skip_reason as gateway_skip_reason
from fleetpilot.testing.gie_epp import GIE_VERSION, GieEpp
from fleetpilot.testing.gie_epp import skip_reason as gie_skip_reason
from fleetpilot.testing.polling import eventually, eventually_async
from tests.routing.support import FakeEngine

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]
#: The node the pool's pods are bound to: tainted, so no other test's pod lands there.
NODE = "gie-pool-node"
NODE_TAINT = {"key": "fleetpilot.dev/gie-pool", "value": "true", "effect": "NoSchedule"}
#: The label the EPP selects its pool's pods by.
POOL = {"app": "gie-pool"}
#: Loopback pod IPs: the reference engines', and the engine doubles' of GIE's scoring cases.
ENGINE_IPS = ("127.0.0.2", "127.0.0.3")
DOUBLE_IPS = ("127.0.0.4", "127.0.0.5", "127.0.0.6")
MODEL = "chat"
MESSAGES = [{"role": "user", "content": "Hello through GIE's picker"}]
#: Long enough for GIE's prefix-cache scorer (64-character blocks of the JSON messages).
CONVERSATION = [
    {"role": "system", "content": "You are the assistant of a prefix-cache test. " * 20},
    *MESSAGES,
]


@pytest.fixture(autouse=True)
def _gie_can_run() -> None:
    reason = gateway_skip_reason() or gie_skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def pool_node(control_plane: Cluster) -> Iterator[str]:
    """A Node for the pool's pods to be bound to (a pod bound to a node that does not exist is
    deleted by the pod garbage collector), tainted so the scheduler puts nothing else there."""
    if not control_plane.fake_nodes:
        pytest.skip("the pool's pods are loopback processes of this machine: our control plane")
    with control_plane.api_client() as api:
        core = k8s.CoreV1Api(api)
        core.create_node(
            k8s.V1Node(
                metadata=k8s.V1ObjectMeta(name=NODE, labels={"fleetpilot.dev/fake-node": "true"}),
                spec=k8s.V1NodeSpec(taints=[k8s.V1Taint(**NODE_TAINT)]),
            )
        )
        try:
            yield NODE
        finally:
            core.delete_node(NODE)


def common_free_port(hosts: Sequence[str]) -> int:
    """A port free on every one of ``hosts`` now (the pool's one target port)."""

    def candidate() -> int | None:
        port = free_port(hosts[0])
        return None if any(port_in_use(port, host) for host in hosts) else port

    return eventually("a port free on " + ", ".join(hosts), candidate, 30)


@dataclass
class ReferenceEngines:
    port: int
    processes: list[subprocess.Popen[bytes]]

    @property
    def addresses(self) -> list[str]:
        return [f"{ip}:{self.port}" for ip in ENGINE_IPS]

    def served(self) -> dict[str, float]:
        """Requests each engine finished (vLLM's ``request_success_total``), by address."""
        served = {}
        for address in self.addresses:
            text = httpx.get(f"http://{address}/metrics", timeout=10).text
            served[address] = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:request_success_total{")
            )
        return served


@pytest.fixture(scope="module")
def reference_engines() -> Iterator[ReferenceEngines]:
    """Two reference engines, one per pod IP of ENGINE_IPS, on the same port."""
    port = common_free_port(ENGINE_IPS)
    with tempfile.TemporaryDirectory(prefix="gie-engines-") as logs:
        processes = []
        try:
            for ip in ENGINE_IPS:
                log = (Path(logs) / f"{ip}.log").open("wb")
                with log:
                    processes.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                "fleetpilot.engine.reference.server",
                                *("--host", ip, "--port", str(port)),
                                *("--model-config", "small", "--served-model-name", MODEL),
                                *("--max-model-len", "1024", "--max-num-seqs", "4"),
                                *("--log-level", "warning"),
                            ],
                            cwd=ROOT,
                            stdout=subprocess.DEVNULL,
                            stderr=log,
                        )
                    )
            engines = ReferenceEngines(port, processes)
            for address in engines.addresses:
                eventually(
                    f"the reference engine at {address} healthy",
                    lambda a=address: (
                        True
                        if httpx.get(f"http://{a}/health", timeout=5).status_code == 200
                        else None
                    ),
                    120,
                    ignoring=(httpx.HTTPError,),
                    context=lambda: "\n".join(p.read_text() for p in Path(logs).iterdir()),
                )
            yield engines
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def make_pods(api: k8s.ApiClient, namespace: str, node: str, ips: Mapping[str, str]) -> None:
    """Pods ``name -> ip`` of the pool, bound to ``node``, then Running and Ready at ``ip`` as
    their kubelet would report them (through the status subresource)."""
    core = k8s.CoreV1Api(api)
    for name, ip in ips.items():
        core.create_namespaced_pod(
            namespace,
            k8s.V1Pod(
                metadata=k8s.V1ObjectMeta(name=name, labels=dict(POOL)),
                spec=k8s.V1PodSpec(
                    node_name=node,
                    tolerations=[k8s.V1Toleration(operator="Exists")],
                    containers=[k8s.V1Container(name="engine", image="model-server:test")],
                ),
            ),
        )
        status = {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [
                {"type": kind, "status": "True"}
                for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
            ],
        }
        core.patch_namespaced_pod_status(name, namespace, {"status": status})


@dataclass
class Pool:
    """GIE's EPP over a namespace's pods, and gateways in front of it."""

    epp: GieEpp
    gateway: Gateway
    gateways: list[Gateway] = field(default_factory=list)  # every one started, to stop

    def client(self, gateway: Gateway | None = None) -> openai.AsyncOpenAI:
        url = (gateway or self.gateway).url
        return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def gateway_with_subset(self, subset: Sequence[str]) -> Gateway:
        """Another gateway in front of the same picker, sending ``subset`` as its hint."""
        gateway = await asyncio.to_thread(Gateway(self.epp.address, subset=subset).start)
        self.gateways.append(gateway)
        return gateway

    async def sees(self, queues: Mapping[str, float]) -> None:
        """Until GIE's last scrape of each pod's metrics reported ``queues`` (by pod name):
        its scores are then computed on the figures the test set."""
        want = {f"{pod}-rank-0": float(q) for pod, q in queues.items()}
        await eventually_async(
            "GIE to have scraped every pod's queue",
            lambda: asyncio.to_thread(self.epp.queue_sizes),
            60,
            until=lambda seen: seen == want,
            interval=0.1,
            context=self.epp.log,
        )

    async def picks(self, count: int) -> list[str]:
        """GIE's picks so far, once there are ``count`` (its log is written as it picks)."""
        return await eventually_async(
            f"GIE to have logged {count} picks",
            lambda: asyncio.to_thread(self.epp.picks),
            30,
            until=lambda picks: len(picks) == count,
            context=self.epp.log,
        )


@contextlib.asynccontextmanager
async def gie_pool(
    control_plane: Cluster,
    api: k8s.ApiClient,
    namespace: str,
    node: str,
    ips: Mapping[str, str],
    port: int,
    *,
    profile: str = "default",
) -> AsyncIterator[Pool]:
    """Pods ``name -> ip`` (the pool's target port ``port``), GIE's EPP over them with
    ``profile`` once it knows them all, and the gateway in front."""
    await asyncio.to_thread(make_pods, api, namespace, node, ips)
    # Verbosity 3 logs each pick, which the tests compare with where requests landed.
    epp = GieEpp(control_plane.kubeconfig, namespace, POOL, [port], profile=profile, verbosity=3)
    await asyncio.to_thread(epp.start)
    gateways: list[Gateway] = []
    try:
        gateway = await asyncio.to_thread(Gateway(epp.address).start)
        gateways.append(gateway)
        pool = Pool(epp, gateway, gateways)
        await eventually_async(
            "GIE to know every pod of the pool",
            lambda: asyncio.to_thread(epp.queue_sizes),
            60,
            until=lambda seen: set(seen) == {f"{name}-rank-0" for name in ips},
            interval=0.1,
            context=epp.log,
        )
        yield pool
    finally:
        for gateway in gateways:
            await asyncio.to_thread(gateway.stop)
        await asyncio.to_thread(epp.stop)


def test_the_build_pins_gies_release() -> None:
    go_mod = (ROOT / "e2e" / "gie-epp" / "go.mod").read_text()
    assert f"sigs.k8s.io/gateway-api-inference-extension {GIE_VERSION}" in go_mod
    assert "tool sigs.k8s.io/gateway-api-inference-extension/cmd/epp" in go_mod


# --- Chats through GIE's picker to reference engines ------------------------------------------


@pytest_asyncio.fixture
async def chat_pool(
    control_plane: Cluster,
    k8s_api: k8s.ApiClient,
    namespace: str,
    pool_node: str,
    reference_engines: ReferenceEngines,
) -> AsyncIterator[tuple[Pool, ReferenceEngines]]:
    ips = {f"engine-{i}": ip for i, ip in enumerate(ENGINE_IPS)}
    async with gie_pool(
        control_plane, k8s_api, namespace, pool_node, ips, reference_engines.port
    ) as pool:
        yield pool, reference_engines


@pytest.mark.asyncio
async def test_the_openai_client_chats_through_gies_picker_whole_and_streamed(
    chat_pool: tuple[Pool, ReferenceEngines],
) -> None:
    pool, engines = chat_pool
    before = await asyncio.to_thread(engines.served)
    async with pool.client() as client:
        reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
        assert reply.model == MODEL
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert reply.usage is not None
        assert reply.usage.completion_tokens > 0
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, stream=True
        )
        chunks = [chunk async for chunk in stream]
    # Streamed through GIE chunk by chunk (it passes an event stream on as it comes).
    assert len(chunks) > 2
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # Each request was served by the engine GIE picked for it, and only there.
    picks = await pool.picks(2)
    assert set(picks) <= set(engines.addresses)
    picked = {a: before[a] + picks.count(a) for a in engines.addresses}
    await eventually_async(
        "each engine to have served what GIE picked it for",
        lambda: asyncio.to_thread(engines.served),
        30,
        until=lambda served: served == picked,
    )


@pytest.mark.asyncio
async def test_gies_refusals_and_passthrough_reach_the_client(
    chat_pool: tuple[Pool, ReferenceEngines],
) -> None:
    """v1.3.0's answers: bad JSON and a body without a model are GIE's 400s (its
    ImmediateResponse, a plain-text body); a model GIE knows nothing of (no
    InferenceObjective, no rewrite) passes through to the picked engine as asked, which
    answers its own 404 - GIE does not keep a model list."""
    pool, engines = chat_pool
    async with httpx.AsyncClient(timeout=60) as http:
        url = pool.gateway.url + "/v1/chat/completions"
        bad = await http.post(
            url, content=b"{not json", headers={"content-type": "application/json"}
        )
        assert (bad.status_code, bad.text) == (
            400,
            "inference gateway: BadRequest - Error unmarshaling request body",
        )
        no_model = await http.post(url, json={"messages": MESSAGES})
        assert (no_model.status_code, no_model.text) == (
            400,
            "inference gateway: BadRequest - model not found in request body",
        )
    assert await asyncio.to_thread(pool.epp.picks) == []
    async with pool.client() as client:
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert "The model `gpt-4` does not exist." in str(unknown.value)  # the engine's words
    (pick,) = await pool.picks(1)
    assert pick in engines.addresses


# --- GIE's hermetic expectations, end to end ---------------------------------------------------


@dataclass
class VllmDouble(FakeEngine):
    """An engine double whose ``/metrics`` are typed as vLLM's are (``# TYPE ... gauge`` per
    family): GIE reads a gauge's value only from a family typed gauge (an untyped
    ``vllm:kv_cache_usage_perc`` reads as 0 to it)."""

    async def _metrics(self, request: web.Request) -> web.Response:
        labels = f'{{engine="0",model_name="{MODEL}"}}'
        text = "".join(
            f"# TYPE {name} gauge\n{name}{labels} {value}\n"
            for name, value in (
                ("vllm:num_requests_waiting", self.waiting),
                ("vllm:num_requests_running", self.running),
                ("vllm:kv_cache_usage_perc", self.kv_usage),
            )
        )
        return web.Response(text=text)


@dataclass
class BigAnswerEngine(VllmDouble):
    """An engine double whose whole (not streamed) answer is bigger than the gateway's 16 KiB
    body chunks: GIE holds such a body until its last chunk and passes it on whole."""

    padding: int = 100_000

    def _answer(self, request: web.Request, body: dict[str, Any]) -> dict[str, Any]:
        answer = super()._answer(request, body)
        answer["choices"][0]["message"]["content"] += " " + "x" * self.padding
        return answer


@contextlib.asynccontextmanager
async def doubles(
    *figures: tuple[float, float], big: bool = False
) -> AsyncIterator[tuple[list[FakeEngine], int]]:
    """Engine doubles ``pod-<i>`` at DOUBLE_IPS on one port, each reporting (queue, KV usage)
    of ``figures`` - GIE's ``P(i, queue, kv)`` - on its vLLM metrics."""
    port = await asyncio.to_thread(common_free_port, DOUBLE_IPS[: max(1, len(figures))])
    kind = BigAnswerEngine if big else VllmDouble
    engines = [
        kind(f"pod-{i}", waiting=queue, kv_usage=kv, host=DOUBLE_IPS[i], port=port)
        for i, (queue, kv) in enumerate(figures)
    ]
    for engine in engines:
        await engine.start()
    try:
        yield engines, port
    finally:
        for engine in engines:
            await engine.stop()


@contextlib.asynccontextmanager
async def scoring_pool(
    control_plane: Cluster,
    api: k8s.ApiClient,
    namespace: str,
    node: str,
    *figures: tuple[float, float],
    profile: str = "default",
    big: bool = False,
) -> AsyncIterator[tuple[Pool, list[FakeEngine]]]:
    async with doubles(*figures, big=big) as (engines, port):
        ips = {e.name: e.host for e in engines}
        async with gie_pool(
            control_plane, api, namespace, node, ips, port, profile=profile
        ) as pool:
            await pool.sees({e.name: e.waiting for e in engines})
            yield pool, engines


@pytest.mark.asyncio
async def test_an_empty_pool_gets_gies_errors(
    control_plane: Cluster, k8s_api: k8s.ApiClient, namespace: str, pool_node: str
) -> None:
    """hermetic_test.go, "no backend pods available": a request without a body (GIE picks
    any pod at its headers) is GIE's 500; one with a body finds no candidate, GIE's 503."""
    async with (
        scoring_pool(control_plane, k8s_api, namespace, pool_node) as (pool, _),
        httpx.AsyncClient(timeout=60) as http,
    ):
        models = await http.get(pool.gateway.url + "/v1/models")
        assert (models.status_code, models.text) == (
            500,
            "inference gateway: Internal - no pods available in datastore",
        )
        chat = await http.post(
            pool.gateway.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}
        )
        assert (chat.status_code, chat.text) == (
            503,
            "inference gateway: ServiceUnavailable - "
            "failed to find candidate pods for serving the request",
        )


def served_by(engines: Sequence[FakeEngine]) -> list[int]:
    return [len(e.requests) for e in engines]


def prompt(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.mark.asyncio
async def test_gie_picks_the_lower_queue_and_kv_usage(
    control_plane: Cluster, k8s_api: k8s.ApiClient, namespace: str, pool_node: str
) -> None:
    """hermetic_test.go, "select lower queue and kv cache": P(0, 3, 0.2), P(1, 0, 0.1),
    P(2, 10, 0.2) -> pod 1. The request reaches pod 1 with GIE's headers (its request id)
    and without the destination header, the body's model as sent."""
    async with (
        scoring_pool(
            control_plane, k8s_api, namespace, pool_node, (3, 0.2), (0, 0.1), (10, 0.2)
        ) as (pool, engines),
        pool.client() as client,
    ):
        for i in range(3):
            reply = await client.chat.completions.create(model="my-model", messages=prompt(f"{i}"))
            assert reply.choices[0].message.content == "from pod-1"
        assert served_by(engines) == [0, 3, 0]
        assert await pool.picks(3) == [engines[1].address] * 3
        assert {r["model"] for r in engines[1].requests} == {"my-model"}
        for headers in engines[1].headers:
            assert re.fullmatch(r"[0-9a-f-]{36}", headers["x-request-id"])
            assert "x-gateway-destination-endpoint" not in headers


@pytest.mark.asyncio
async def test_gie_does_not_shed_by_default_when_every_pod_is_saturated(
    control_plane: Cluster, k8s_api: k8s.ApiClient, namespace: str, pool_node: str
) -> None:
    """hermetic_test.go, "do not shed requests by default": P(0, 6, 0.2), P(1, 0, 0.85),
    P(2, 10, 0.9) - every pod past GIE's saturation thresholds (queue 5, KV 0.8) - and a
    request of the default priority is served, not refused with a 429. There pod 0 wins by
    LoRA affinity; the chart's default profile has no LoRA scorer, and its weights give pod 0
    2*(4/10) + 2*0.8 = 2.4 against pod 1's 2*1 + 2*0.15 = 2.3: pod 0 again."""
    async with (
        scoring_pool(
            control_plane, k8s_api, namespace, pool_node, (6, 0.2), (0, 0.85), (10, 0.9)
        ) as (pool, engines),
        pool.client() as client,
    ):
        reply = await client.chat.completions.create(model="sql-lora", messages=prompt("t4"))
        assert reply.choices[0].message.content == "from pod-0"
        assert served_by(engines) == [1, 0, 0]


@pytest.mark.asyncio
async def test_gie_keeps_to_the_gateways_subset_hint(
    control_plane: Cluster, k8s_api: k8s.ApiClient, namespace: str, pool_node: str
) -> None:
    """hermetic_test.go's subsetting cases, the hint sent by the gateway in the
    ``envoy.lb.subset_hint`` metadata: the best of the subset (pod 1 of all three); the only
    endpoint of the subset despite its load (pod 2); no pod in the subset - GIE's 503."""
    async with scoring_pool(
        control_plane, k8s_api, namespace, pool_node, (0, 0.2), (0, 0.1), (10, 0.2)
    ) as (pool, engines):
        addresses = [e.address for e in engines]
        best = await pool.gateway_with_subset(addresses)
        partial = await pool.gateway_with_subset([addresses[2]])
        missing = await pool.gateway_with_subset([f"{DOUBLE_IPS[0][:-1]}99:{engines[0].port}"])
        async with pool.client(best) as client:
            reply = await client.chat.completions.create(model="sql-lora", messages=prompt("b"))
            assert reply.choices[0].message.content == "from pod-1"
        async with pool.client(partial) as client:
            reply = await client.chat.completions.create(model="sql-lora", messages=prompt("p"))
            assert reply.choices[0].message.content == "from pod-2"
        async with httpx.AsyncClient(timeout=60) as http:
            refused = await http.post(
                missing.url + "/v1/chat/completions",
                json={"model": "sql-lora", "messages": prompt("m")},
            )
        assert (refused.status_code, refused.text) == (
            503,
            "inference gateway: ServiceUnavailable - "
            "failed to find candidate pods for serving the request",
        )
        assert served_by(engines) == [0, 1, 1]


async def first_turn(pool: Pool, engines: Sequence[FakeEngine]) -> FakeEngine:
    """A conversation's first turn (every pod alike: GIE picks any); the pod that served it."""
    async with pool.client() as client:
        await client.chat.completions.create(model=MODEL, messages=CONVERSATION)
    (first,) = [e for e in engines if e.requests]
    return first


async def next_turn(pool: Pool, engines: Sequence[FakeEngine]) -> str:
    """The conversation again, once GIE saw the pods' figures now; who answered."""
    await pool.sees({e.name: e.waiting for e in engines})
    async with pool.client() as client:
        reply = await client.chat.completions.create(model=MODEL, messages=CONVERSATION)
    return str(reply.choices[0].message.content).removeprefix("from ")


@pytest.mark.asyncio
async def test_gies_prefix_scorer_weighs_a_cached_prefix_against_load(
    control_plane: Cluster, k8s_api: k8s.ApiClient, namespace: str, pool_node: str
) -> None:
    """The prefix-cache scorer (GIE's proposal 0602) in the default profile (queue 2, KV 2,
    prefix 3): a conversation's next turn returns to the pod that served its first (scored
    1.0 for its cached blocks, the others 0) while that pod is moderately loaded (queue 3,
    KV 0.3: 0 + 1.4 + 3 = 4.4 against 2 + 2 + 0 = 4), and goes elsewhere once it is heavily
    loaded (KV 0.9: 0 + 0.2 + 3 = 3.2 against 4)."""
    async with scoring_pool(
        control_plane, k8s_api, namespace, pool_node, (0, 0.0), (0, 0.0), (0, 0.0)
    ) as (pool, engines):
        first = await first_turn(pool, engines)
        first.waiting, first.kv_usage = 3, 0.3
        assert await next_turn(pool, engines) == first.name
        first.waiting, first.kv_usage = 3, 0.9
        assert await next_turn(pool, engines) != first.name
        assert len(first.requests) == 2


@pytest.mark.asyncio
async def test_gies_prefix_only_profile_keeps_a_conversation_on_its_pod_under_any_load(
    control_plane: Cluster, k8s_api: k8s.ApiClient, namespace: str, pool_node: str
) -> None:
    """The "prefix" profile (the prefix-cache scorer alone) is GIE's picker configured by its
    config text: the next turn stays on the pod that served the first however loaded it is."""
    async with scoring_pool(
        control_plane, k8s_api, namespace, pool_node, (0, 0.0), (0, 0.0), profile="prefix"
    ) as (pool, engines):
        first = await first_turn(pool, engines)
        first.waiting, first.kv_usage = 10, 0.9
        assert await next_turn(pool, engines) == first.name
        assert await next_turn(pool, engines) == first.name


@pytest.mark.asyncio
async def test_a_whole_answer_bigger_than_a_chunk_passes_through_gie_whole(
    control_plane: Cluster, k8s_api: k8s.ApiClient, namespace: str, pool_node: str
) -> None:
    """hermetic_test.go, "response buffering: multi-chunk JSON": GIE holds a JSON answer
    until its last chunk and answers it whole (a gateway waiting for an answer per chunk
    would stall here)."""
    async with (
        scoring_pool(control_plane, k8s_api, namespace, pool_node, (0, 0.1), big=True) as (
            pool,
            _,
        ),
        pool.client() as client,
    ):
        reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert reply.choices[0].message.content == "from pod-0 " + "x" * BigAnswerEngine.padding


# --- GIE's conformance suite, the part about the gateway and its picker -------------------------
#
# The suite (conformance/ of the v1.3.0 module; v1.6.2's lives in a nested module the proxy does
# not serve) runs against a Gateway API implementation: every test needs a GatewayClass, a
# Gateway with an address and HTTPRoute status, and pulls its EPP and echo-server images. What
# its data-plane tests assert of a gateway and an EPP runs here instead, with GIE's EPP
# deployed as the suite deploys it (--pool-name over an InferencePool object, the suite's
# EndpointPickerConfig, verbosity 4) and engine doubles in place of the echo server (each
# answer names the engine, as the echo server names its pod and port).

#: conformance/resources/base.yaml's ``conformance-plugins.yaml``, verbatim.
CONFORMANCE_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: header-based-testing-filter
- type: destination-endpoint-served-verifier
schedulingProfiles:
- name: conformance-profile
  plugins:
  - pluginRef: header-based-testing-filter
"""
#: The header GIE's header-based-testing-filter keeps endpoints by (``ip`` or ``ip:port``).
SELECTION = "test-epp-endpoint-selection"
#: Where GIE's destination-endpoint-served-verifier echoes the served endpoint it was told.
SERVED = "x-conformance-test-served-endpoint"
CONFORMANCE_BODY = {
    "model": "conformance-fake-model",
    "prompt": "Write as if you were a critic: San Francisco",
}
INFERENCE_POOL = "primary-inference-pool"


@dataclass
class ConformancePool:
    pool: Pool
    ips: list[str]  # pod i's IP
    ports: list[int]  # the pool's target ports (DP ranks)

    async def post(self, http: httpx.AsyncClient, selection: str) -> httpx.Response:
        return await http.post(
            self.pool.gateway.url + "/v1/completions",
            json=CONFORMANCE_BODY,
            headers={SELECTION: selection},
        )

    async def served_only_by(
        self, http: httpx.AsyncClient, selection: str, allowed: set[str], total: int = 100
    ) -> set[str]:
        """The suite's assertTrafficOnlyReachesToExpectedPods: ``total`` requests, 10 at a
        time, each answered 200 by an engine (``ip:port``) of ``allowed``; those that served."""
        limit = asyncio.Semaphore(10)

        async def one() -> str:
            async with limit:
                response = await self.post(http, selection)
            assert response.status_code == 200, response.text
            served = str(response.json()["served_by"])
            assert served in allowed, f"{selection!r} reached {served}, not one of {allowed}"
            return served

        return set(await asyncio.gather(*(one() for _ in range(total))))


@contextlib.asynccontextmanager
async def conformance_pool(
    control_plane: Cluster, kube: Kube, namespace: str, node: str, *, ranks: int = 1
) -> AsyncIterator[ConformancePool]:
    """Three pods (the suite's ModelServerPodReplicas) of ``ranks`` target ports each, an
    engine double per pod and port, the InferencePool over them, GIE's EPP for that pool."""
    ips = list(DOUBLE_IPS)
    ports: list[int] = []
    while len(ports) < ranks:
        port = await asyncio.to_thread(common_free_port, ips)
        ports += [port] if port not in ports else []
    engines = [VllmDouble(f"{ip}:{port}", host=ip, port=port) for ip in ips for port in ports]
    for engine in engines:
        await engine.start()
    await asyncio.to_thread(
        make_pods, kube.api, namespace, node, {f"pod-{i}": ip for i, ip in enumerate(ips)}
    )
    await asyncio.to_thread(
        kube.request,
        "POST",
        f"/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools",
        body={
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": INFERENCE_POOL, "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": dict(POOL)},
                "targetPorts": [{"number": p} for p in ports],
                "endpointPickerRef": {"name": "gie-epp", "port": {"number": 9002}},
            },
        },
    )
    epp = GieEpp(
        control_plane.kubeconfig,
        namespace,
        {},
        [],
        config_text=CONFORMANCE_CONFIG,
        pool_name=INFERENCE_POOL,
        verbosity=4,
    )
    gateways: list[Gateway] = []
    try:
        await asyncio.to_thread(epp.start)
        gateways.append(await asyncio.to_thread(Gateway(epp.address).start))
        pool = Pool(epp, gateways[0], gateways)
        await eventually_async(
            "GIE to know every endpoint of the pool",
            lambda: asyncio.to_thread(epp.queue_sizes),
            60,
            until=lambda seen: len(seen) == len(engines),
            interval=0.1,
            context=epp.log,
        )
        yield ConformancePool(pool, ips, ports)
    finally:
        for gateway in gateways:
            await asyncio.to_thread(gateway.stop)
        await asyncio.to_thread(epp.stop)
        for engine in engines:
            await engine.stop()


@pytest.mark.asyncio
async def test_conformance_gateway_following_epp_routing(
    control_plane: Cluster, kube: Kube, gateway_crds: None, namespace: str, pool_node: str
) -> None:
    """GatewayFollowingEPPRouting: with the pod IPs GIE's testing filter is told to keep,
    every request reaches one of those pods - each pod alone first, then one, two, all."""
    async with (
        conformance_pool(control_plane, kube, namespace, pool_node) as pool,
        httpx.AsyncClient(timeout=60) as http,
    ):
        (port,) = pool.ports
        at = [f"{ip}:{port}" for ip in pool.ips]
        for i, ip in enumerate(pool.ips):
            assert await pool.served_only_by(http, ip, {at[i]}, total=1) == {at[i]}
        for chosen in ([2], [0, 1], [0, 1, 2]):
            selection = ",".join(pool.ips[i] for i in chosen)
            served = await pool.served_only_by(http, selection, {at[i] for i in chosen})
            # GIE's picker takes one of the kept pods at random: 100 requests reach each.
            assert served == {at[i] for i in chosen}


@pytest.mark.asyncio
async def test_conformance_gateway_following_epp_routing_with_data_parallelism(
    control_plane: Cluster, kube: Kube, gateway_crds: None, namespace: str, pool_node: str
) -> None:
    """GatewayFollowingEPPRoutingWithDataParallelism: three target ports (DP ranks) a pod,
    an endpoint each; the filter keeps a pod by its IP (any rank) or one rank by ip:port,
    and the traffic stays on what it kept."""
    async with (
        conformance_pool(control_plane, kube, namespace, pool_node, ranks=3) as pool,
        httpx.AsyncClient(timeout=60) as http,
    ):
        ips, ports = pool.ips, pool.ports

        def ranks(ip: str, only: Sequence[int] | None = None) -> set[str]:
            return {f"{ip}:{p}" for p in (only if only is not None else ports)}

        for ip in ips:
            assert await pool.served_only_by(http, ip, ranks(ip), total=1) <= ranks(ip)
        cases = [
            (ips[1], ranks(ips[1])),
            (f"{ips[0]},{ips[2]}:{ports[1]}", ranks(ips[0]) | ranks(ips[2], [ports[1]])),
            (
                f"{ips[0]},{ips[1]}:{ports[0]},{ips[1]}:{ports[2]},{ips[2]}",
                ranks(ips[0]) | ranks(ips[1], [ports[0], ports[2]]) | ranks(ips[2]),
            ),
        ]
        for selection, allowed in cases:
            served = await pool.served_only_by(http, selection, allowed)
            # GIE's filter keeps one endpoint a selected IP (it de-duplicates by IP), and
            # its picker takes one of those at random: 100 requests reach every selected pod
            # (a miss has odds below 3 * (2/3)**100).
            assert {s.rsplit(":", 1)[0] for s in served} == {a.rsplit(":", 1)[0] for a in allowed}


@pytest.mark.asyncio
async def test_conformance_gateway_destination_endpoint_served(
    control_plane: Cluster, kube: Kube, gateway_crds: None, namespace: str, pool_node: str
) -> None:
    """GatewayDestinationEndpointServed: the gateway tells the EPP which endpoint served
    (``x-gateway-destination-endpoint-served`` in the ``envoy.lb`` metadata of the response
    messages); GIE's verifier plugin echoes it back in a response header."""
    async with (
        conformance_pool(control_plane, kube, namespace, pool_node) as pool,
        httpx.AsyncClient(timeout=60) as http,
    ):
        (port,) = pool.ports
        for ip in pool.ips:
            response = await pool.post(http, ip)
            assert response.status_code == 200
            assert response.headers[SERVED] == f"{ip}:{port}"
            assert response.json()["served_by"] == f"{ip}:{port}"
