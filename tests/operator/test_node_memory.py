"""The nodes' memory an engine pod is checked against (issue 46's node check, filled by the
operator): the pure selection by GPU product, the planner's use of it, the cached reader on
the in-memory API server (its TTL, a refusal to read, an error), the reconciler surfacing a
refused pod as the plan-error path does - and the same against a real API server's Nodes."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from fleetpilot.api.capacity import GIB
from fleetpilot.api.pod_template import GPU_PRODUCT_LABEL
from fleetpilot.kube.client import Kube, KubeError, Obj
from fleetpilot.operator.node_memory import (
    NodeMemory,
    NodeMemoryReader,
    allocatable_memory,
    node_memory_of,
    unmatched_products,
)
from fleetpilot.operator.plan_types import PlanError, PlanOptions
from fleetpilot.operator.planner import node_memory_for, plan
from fleetpilot.operator.reconcile import Reconciler
from fleetpilot.testing.polling import eventually
from tests.factories import make_manifest, make_service, make_tier
from tests.support.kube import FakeKube

H100 = "NVIDIA-H100-80GB-HBM3"
L4 = "NVIDIA-L4"
MANAGER = "tests"


def node_object(name: str, memory: str | None, product: str | None = None) -> Obj:
    labels = {"kubernetes.io/hostname": name}
    if product:
        labels[GPU_PRODUCT_LABEL] = product
    obj: Obj = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
    if memory is not None:
        obj["status"] = {"allocatable": {"memory": memory, "cpu": "8"}}
    return obj


def add_node(kube: Kube, name: str, memory: str, product: str | None = None) -> None:
    """A Node as a kubelet registers one: created, then its status (allocatable) reported."""
    obj = node_object(name, memory, product)
    status = obj.pop("status")
    kube.create(obj, MANAGER)
    kube.patch_status("Node", "", name, status | {"capacity": status["allocatable"]}, MANAGER)


# -- the pure selection ---------------------------------------------------------------------


def test_the_largest_node_of_each_gpu_product_and_of_all() -> None:
    """Allocatable memory by nvidia.com/gpu.product (the largest of each) and of all nodes:
    a node without the label (a CPU node) counts for all only, one that reports no memory
    (not registered yet) for nothing."""
    nodes = [
        node_object("h100-a", "1000Gi", H100),
        node_object("h100-b", "2000Gi", H100),
        node_object("l4", "500Gi", L4),
        node_object("cpu", "3000Gi"),
        node_object("new", None, H100),
    ]
    assert node_memory_of(nodes) == NodeMemory(3000 * GIB, {H100: 2000 * GIB, L4: 500 * GIB})
    assert node_memory_of([]) == NodeMemory(None, {})
    # A kubelet reports bytes or Ki; both are quantities.
    assert allocatable_memory(node_object("n", "131072Ki")) == 128 * 1024**2
    assert allocatable_memory(node_object("n", "lots")) is None


def test_a_product_no_node_carries_is_named() -> None:
    service = make_service(
        tiers=[
            make_tier("a", up_to=0.3, resources={"gpuProduct": H100}),
            make_tier("b", up_to=0.6, resources={"gpuProduct": "NVIDIA-L40"}),
            make_tier("c", engine={"backend": "reference"}, resources={"gpuProduct": "X"}),
        ]
    )
    assert unmatched_products(service, NodeMemory(10 * GIB, {H100: 10 * GIB})) == ["NVIDIA-L40"]


# -- the planner ----------------------------------------------------------------------------


def _options(largest: int, **by_product: int) -> PlanOptions:
    return PlanOptions(node_memory=largest, node_memory_by_product=by_product)


def test_a_gpu_tier_is_checked_against_the_nodes_of_its_product() -> None:
    """A tier with resources.gpuProduct runs only on nodes of that product: a pod larger than
    the largest of them is refused at resources.memory, naming the label - even where a
    node of another kind is larger."""
    service = make_service(tiers=[make_tier(resources={"gpuProduct": H100, "memory": "200Gi"})])
    options = PlanOptions(node_memory=3000 * GIB, node_memory_by_product={H100: 100 * GIB})
    with pytest.raises(PlanError) as info:
        plan(service, options)
    assert info.value.field == "spec.tiers[0].resources.memory"
    assert "asks for 200 GiB" in info.value.message
    assert "more than the 100 GiB a node can give" in info.value.message
    assert f"the nodes labelled {GPU_PRODUCT_LABEL}={H100}" in info.value.message
    plan(service, PlanOptions(node_memory=3000 * GIB, node_memory_by_product={H100: 200 * GIB}))


def test_a_product_no_node_carries_is_not_checked() -> None:
    """No node of the tier's product (a node pool not there yet, a label spelt otherwise):
    nothing to compare with, so the pod is not refused on memory."""
    service = make_service(tiers=[make_tier(resources={"gpuProduct": H100, "memory": "200Gi"})])
    plan(service, PlanOptions(node_memory=1 * GIB, node_memory_by_product={L4: 1 * GIB}))


def test_a_tier_without_a_product_and_a_reference_tier_take_the_largest_node() -> None:
    """No product: any node may run it, so the largest of all counts. A reference tier has
    no GPU and no product selector (its gpuProduct is ignored): likewise."""
    plain = make_tier(resources={"memory": "200Gi"})
    reference = make_tier(
        "main",
        model="reference-tiny",
        engine={"backend": "reference"},
        resources={"gpuProduct": H100},
    )
    tiny = {H100: 1}
    for tier in (plain, reference):
        service = make_service(tiers=[tier])
        plan(service, PlanOptions(node_memory=300 * GIB, node_memory_by_product=tiny))
        with pytest.raises(PlanError) as info:
            plan(service, PlanOptions(node_memory=1, node_memory_by_product=tiny))
        assert "the largest allocatable memory of the cluster's nodes" in info.value.message
    (role,) = make_service(tiers=[plain]).spec.tiers[0].roles()
    assert node_memory_for(role.tier, PlanOptions(node_memory=5))[0] == 5  # the CLI's value


# -- the reader -----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _node_lists(kube: FakeKube) -> int:
    return sum(1 for c in kube.calls if c.method == "GET" and c.kind == "Node")


def test_the_nodes_are_listed_once_per_ttl_from_the_watch_cache() -> None:
    """However many reconciles plan meanwhile, one LIST per TTL, served from the API
    server's watch cache (resourceVersion=0); a changed reading counts as a change."""
    kube, clock = FakeKube(), Clock()
    add_node(kube, "gpu-0", "512Gi", H100)
    reader = NodeMemoryReader(kube, ttl_s=60.0, clock=clock)
    assert reader.read() == NodeMemory(512 * GIB, {H100: 512 * GIB})
    for _ in range(5):
        reader.read()
    assert _node_lists(kube) == 1
    (listing,) = [c for c in kube.calls if c.kind == "Node" and c.method == "GET"]
    assert ("resourceVersion", "0") in listing.query
    assert reader.changes == 1
    add_node(kube, "gpu-1", "1Ti", H100)
    clock.now += 59
    assert reader.read() == NodeMemory(512 * GIB, {H100: 512 * GIB})  # still the old reading
    clock.now += 1
    assert reader.read() == NodeMemory(1024 * GIB, {H100: 1024 * GIB})
    assert (_node_lists(kube), reader.changes) == (2, 2)
    clock.now += 60
    reader.read()
    assert (_node_lists(kube), reader.changes) == (3, 2)  # the same nodes: no change


def test_nodes_the_operator_may_not_read_leave_the_check_off_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """403 (a chart from before the node rule): no reading, so nothing is refused on memory,
    and one structured warning however often it is tried."""
    kube, clock = FakeKube(), Clock()
    kube.refuse("GET", "Node", 403)
    reader = NodeMemoryReader(kube, ttl_s=60.0, clock=clock)
    options = PlanOptions()
    service = make_service(tiers=[make_tier(resources={"gpuProduct": H100, "memory": "9Ti"})])
    with caplog.at_level(logging.WARNING, logger="fleetpilot.operator.node_memory"):
        for _ in range(3):
            assert reader.options(options, service) == options
            clock.now += 60
    (record,) = caplog.records
    assert record.getMessage().startswith("nodes unread")
    assert record.__dict__["cause"] == "forbidden"
    assert _node_lists(kube) == 3


def test_an_error_keeps_the_last_reading_and_no_nodes_mean_no_check(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A timeout or a 500 keeps the last good reading until a read succeeds; a cluster
    whose nodes report no memory gives none (no check), logged once."""
    kube, clock = FakeKube(), Clock()
    reader = NodeMemoryReader(kube, ttl_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="fleetpilot.operator.node_memory"):
        assert reader.read() is None
        clock.now += 60
        assert reader.read() is None
    assert [r.__dict__["cause"] for r in caplog.records] == ["no nodes"]
    add_node(kube, "gpu-0", "512Gi", H100)
    assert reader.refresh() == NodeMemory(512 * GIB, {H100: 512 * GIB})
    kube.refuse("GET", "Node", 500, times=1)
    assert reader.refresh() == NodeMemory(512 * GIB, {H100: 512 * GIB})
    assert reader.refresh() == NodeMemory(512 * GIB, {H100: 512 * GIB})


def test_a_product_without_nodes_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    kube = FakeKube()
    add_node(kube, "gpu-0", "512Gi", L4)
    reader = NodeMemoryReader(kube)
    service = make_service(tiers=[make_tier(resources={"gpuProduct": H100})])
    with caplog.at_level(logging.WARNING, logger="fleetpilot.operator.node_memory"):
        for _ in range(3):
            options = reader.options(PlanOptions(), service)
    assert options.node_memory_by_product == {L4: 512 * GIB}
    (record,) = caplog.records
    assert (record.__dict__["product"], record.__dict__["service"]) == (H100, "ml/chat")


# -- the reconciler -------------------------------------------------------------------------


def _condition(obj: Obj, kind: str) -> Obj:
    (found,) = [c for c in obj["status"]["conditions"] if c["type"] == kind]
    return found  # type: ignore[no-any-return]


def _big_pod_manifest(namespace: str = "ml", name: str = "chat") -> Obj:
    tier = make_tier(resources={"gpuProduct": H100, "memory": "600Gi"})
    return make_manifest(name, namespace=namespace, tiers=[tier])


def test_a_pod_no_node_holds_is_refused_like_any_plan_error_until_one_joins() -> None:
    """The operator plans with the cluster's nodes: a pod larger than every node of its
    product is refused - Ready False, Degraded and Stalled True (PlanRefused) naming the
    field, nothing applied - and the service is listed as refused; once a large enough node
    joins (a new reading), the same spec reconciles."""
    kube = FakeKube()
    add_node(kube, "gpu-0", "512Gi", H100)
    add_node(kube, "cpu-0", "4Ti")
    reader = NodeMemoryReader(kube)
    reconciler = Reconciler(kube, node_memory=reader)
    kube.apply(_big_pod_manifest(), MANAGER)
    live = kube.get("InferenceService", "ml", "chat")
    assert live is not None
    result = reconciler.reconcile(live)
    assert result.refusal is not None
    assert not result.applied
    live = kube.get("InferenceService", "ml", "chat")
    assert live is not None
    for kind, status in (("Ready", "False"), ("Degraded", "True"), ("Stalled", "True")):
        state = _condition(live, kind)
        assert (state["status"], state["reason"]) == (status, "PlanRefused"), kind
    message = _condition(live, "Degraded")["message"]
    assert message.startswith("spec.tiers[0].resources.memory: ")
    assert f"the nodes labelled {GPU_PRODUCT_LABEL}={H100}" in message
    assert reconciler.refused() == [("ml", "chat")]

    add_node(kube, "gpu-1", "1Ti", H100)
    before = reader.changes
    reader.refresh()
    assert reader.changes == before + 1
    result = reconciler.reconcile(live)
    assert result.refusal is None
    assert "Deployment/chat-small" in result.applied
    assert reconciler.refused() == []


def test_without_a_reader_the_reconciler_plans_as_before() -> None:
    """No reader (the tests' reconcilers, `fleetpilot plan`): nothing checked, no node read."""
    kube = FakeKube()
    kube.apply(_big_pod_manifest(), MANAGER)
    live = kube.get("InferenceService", "ml", "chat")
    assert live is not None
    assert Reconciler(kube).reconcile(live).refusal is None
    assert _node_lists(kube) == 0


# -- a real API server ----------------------------------------------------------------------


@pytest.fixture
def nodes(api_server: Kube) -> Iterator[list[str]]:
    """Names of Nodes a test registers, deleted after it (the server is the session's)."""
    names: list[str] = []
    yield names
    for name in names:
        api_server.delete("Node", "", name)


@pytest.mark.cluster
def test_a_real_api_servers_nodes_bound_an_engine_pod(
    api_server: Kube, namespace: str, nodes: list[str]
) -> None:
    """Nodes registered on a real API server (as a kubelet would: created, then their
    allocatable memory in status), read from its watch cache: an H100 tier asking more than
    the H100 nodes give is refused on the real object's status, naming the field; a tier
    without a product is checked against the largest node and plans."""
    suffix = uuid.uuid4().hex[:6]
    for name, memory, product in (
        (f"h100-{suffix}", "512Gi", H100),
        (f"cpu-{suffix}", "4Ti", None),
    ):
        add_node(api_server, name, memory, product)
        nodes.append(name)
    reader = NodeMemoryReader(api_server)
    # The session's server: its only Nodes are the tests' own, each deleted after its test.
    # The reader lists from the watch cache, which may not yet hold the last status write
    # (a CI run read the cpu node without its memory): wait for it, as the operator's next
    # reading would.
    expected = NodeMemory(4096 * GIB, {H100: 512 * GIB})
    eventually("the watch cache holds both nodes' memory",
               lambda: True if reader.refresh() == expected else None)  # fmt: skip
    assert reader.read() == expected
    reconciler = Reconciler(api_server, node_memory=reader)
    live = api_server.apply(_big_pod_manifest(namespace), MANAGER)
    assert reconciler.reconcile(live).refusal is not None
    written = api_server.get("InferenceService", namespace, "chat")
    assert written is not None
    degraded = _condition(written, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "PlanRefused")
    assert "spec.tiers[0].resources.memory" in degraded["message"]
    assert "more than the 512 GiB a node can give" in degraded["message"]
    assert api_server.list("Deployment", namespace, {"fleetpilot.dev/service": "chat"}) == []

    anywhere = make_manifest(
        "anywhere", namespace=namespace, tiers=[make_tier(resources={"memory": "600Gi"})]
    )
    live = api_server.apply(anywhere, MANAGER)
    result = reconciler.reconcile(live)
    assert result.refusal is None
    assert "Deployment/anywhere-small" in result.applied


@pytest.mark.cluster
def test_a_forbidden_node_read_on_a_real_api_server_turns_the_check_off(
    api_server: Kube, impersonated: Any
) -> None:
    """A user without the chart's node rule gets 403 from the real server: no reading, no
    refusal on memory, and the reconcile goes on."""
    with impersonated("system:serviceaccount:default:no-node-rights") as kube:
        with pytest.raises(KubeError) as info:
            kube.list_cluster("Node")
        assert info.value.status == 403
        assert NodeMemoryReader(kube).read() is None
