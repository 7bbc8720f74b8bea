"""A role whose replica spans nodes: planned as a LeaderWorkerSet, its leaders behind a Service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetpilot.api import InferenceService, load_services
from fleetpilot.autoscaler.model import RolePolicy
from fleetpilot.kube import names
from fleetpilot.operator.plan_types import K8sObject, PlanError, PlanOptions
from fleetpilot.operator.planner import plan
from fleetpilot.operator.router_objects import router_config
from tests.factories import make_service, make_tier

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


def _example(name: str) -> InferenceService:
    (service,) = load_services(EXAMPLES / name)
    return service


def _find(objects: list[K8sObject], kind: str, name: str) -> K8sObject:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def _engine(template: K8sObject) -> dict[str, Any]:
    return template["spec"]["containers"][0]  # type: ignore[no-any-return]


@pytest.fixture
def dense() -> list[K8sObject]:
    return plan(_example("llama-405b-multinode.yaml"))


def test_a_replica_over_two_nodes_is_one_leader_worker_set(dense: list[K8sObject]) -> None:
    """The 405B tier is a LeaderWorkerSet of groups of 2 pods, not a Deployment; its groups
    restart whole and roll one surge group at a time, never below the serving count."""
    assert not [
        o for o in dense if o["kind"] == "Deployment" and o["metadata"]["name"] != "dense-router"
    ]
    lws = _find(dense, "LeaderWorkerSet", "dense-main")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["replicas"] == 1
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxSurge": 1,
        "maxUnavailable": 0,
    }
    template = spec["leaderWorkerTemplate"]
    assert template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    annotations = lws["metadata"]["annotations"]
    assert annotations["fleetpilot.dev/gpus-per-replica"] == "16"
    assert annotations["fleetpilot.dev/nodes-per-replica"] == "2"


def test_leader_serves_and_workers_run_headless(dense: list[K8sObject]) -> None:
    """The leader has the API port, the probes and the scrape annotations; a worker has none
    of them (vllm --headless serves no HTTP), and both ask for one node's 8 GPUs with a
    /dev/shm big enough for NCCL."""
    template = _find(dense, "LeaderWorkerSet", "dense-main")["spec"]["leaderWorkerTemplate"]
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    lead, work = _engine(leader), _engine(worker)
    assert [p["name"] for p in lead["ports"]][:1] == ["http"]
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(lead)
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(work)
    assert "prometheus.io/scrape" in leader["metadata"]["annotations"]
    assert "annotations" not in worker["metadata"]
    for container in (lead, work):
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "8"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "--headless" in work["args"]
    assert "--headless" not in lead["args"]
    assert work["args"][work["args"].index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert lead["args"][lead["args"].index("--node-rank") + 1] == "0"
    for pod in (leader, worker):
        shm = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
        assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}]
        assert pod["metadata"]["labels"]["fleetpilot.dev/tier"] == "main"


def test_router_finds_only_the_leaders(dense: list[K8sObject]) -> None:
    """The router's Service selects worker index 0 (the leaders serve the API) and is not named
    as the set: the LWS controller makes that Service itself, publishing not-ready pods so the
    group finds its leader before anything is Ready."""
    service = _find(dense, "Service", "dense-main-leaders")
    assert service["spec"]["selector"][WORKER_INDEX] == "0"
    assert not [
        o for o in dense if o["kind"] == "Service" and o["metadata"]["name"] == "dense-main"
    ]
    (group,) = router_config(_example("llama-405b-multinode.yaml")).tiers[0].endpoints
    assert group.service == "dense-main-leaders"
    pdb = _find(dense, "PodDisruptionBudget", "dense-main")
    assert pdb["spec"]["maxUnavailable"] == 1


def test_wide_expert_parallel_decode_with_rdma_and_one_rack_per_group() -> None:
    """DeepSeek's decode role spans 2 nodes (8 ranks each), asks for an RDMA NIC per pod with
    IPC_LOCK, and is kept to one rack per group; its one-node prefill role stays a Deployment
    without either. The router subscribes to the leader's 8 ranks' KV events."""
    service = _example("deepseek-wide-ep.yaml")
    objects = plan(service)
    decode = _find(objects, "LeaderWorkerSet", "moe-main-decode")
    annotations = decode["metadata"]["annotations"]
    assert (
        annotations["leaderworkerset.sigs.k8s.io/exclusive-topology"]
        == "topology.kubernetes.io/rack"
    )
    template = decode["spec"]["leaderWorkerTemplate"]
    for pod in (template["leaderTemplate"], template["workerTemplate"]):
        container = _engine(pod)
        assert container["resources"]["requests"]["rdma/ib"] == "1"
        assert container["securityContext"]["capabilities"] == {
            "drop": ["ALL"],
            "add": ["IPC_LOCK"],
        }
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "8"
    prefill = _find(objects, "Deployment", "moe-main-prefill")
    container = prefill["spec"]["template"]["spec"]["containers"][0]
    assert "rdma/ib" not in container["resources"]["requests"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    groups = {g.role: g for g in router_config(service).tiers[0].endpoints}
    assert groups["decode"].data_parallel == 8
    assert groups["prefill"].data_parallel == 8


def test_a_data_parallel_replica_is_full_at_every_ranks_batch() -> None:
    """The router and the autoscaler sum running and waiting over a replica's ranks, so its
    batch limit is maxNumSeqs x data: 16 ranks of 256 are full at 4,096, not at 256 (at
    which a replica a sixteenth busy looked saturated, spilled and scaled up)."""
    service = _example("deepseek-wide-ep.yaml")
    groups = {g.role: g for g in router_config(service).tiers[0].endpoints}
    assert groups["decode"].max_num_seqs == 256 * 16
    assert groups["prefill"].max_num_seqs == 256 * 8
    tier = service.spec.tiers[0]
    assert RolePolicy.for_role(tier, "decode").max_num_seqs == 256 * 16
    single = make_service(tiers=[make_tier("main")]).spec.tiers[0]
    assert RolePolicy.for_role(single, "unified").max_num_seqs == 256


def test_without_leader_worker_set_the_role_is_refused() -> None:
    """In a cluster that does not serve LeaderWorkerSet, a multi-node role is refused at its
    parallelism, naming the API and the numbers; one-node services still plan."""
    options = PlanOptions(leader_worker_set_available=False)
    with pytest.raises(PlanError) as info:
        plan(_example("llama-405b-multinode.yaml"), options)
    assert info.value.field == "spec.tiers[0].parallelism"
    assert "leaderworkerset.x-k8s.io/v1" in info.value.message
    assert "2 nodes per replica (16 GPUs, resources.gpusPerNode 8)" in info.value.message
    plan(make_service(tiers=[make_tier("main", tensor=8)]), options)


def test_pod_template_overlay_reaches_leader_and_workers() -> None:
    """The tier's podTemplate is merged into both templates: a worker without the user's
    node placement or env would land elsewhere or miss a setting."""
    tier = make_tier(
        "main",
        parallelism={"tensor": 8, "pipeline": 2},
        podTemplate={
            "nodeSelector": {"pool": "h100"},
            "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        },
    )
    (lws,) = [o for o in plan(make_service(tiers=[tier])) if o["kind"] == "LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    for pod in (template["leaderTemplate"], template["workerTemplate"]):
        assert pod["spec"]["nodeSelector"]["pool"] == "h100"
        assert {"name": "NCCL_DEBUG", "value": "INFO"} in _engine(pod)["env"]


def test_long_names_fit_the_leader_worker_set_controllers_limits() -> None:
    """With 63-character service and tier names, the set's name leaves room for the names the
    LWS and StatefulSet controllers derive from it, and the leaders' Service fits 63."""
    tier = make_tier("t" * 63, parallelism={"tensor": 8, "pipeline": 2})
    service = make_service("s" * 63, tiers=[tier])
    objects = plan(service)
    (lws,) = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    assert len(lws["metadata"]["name"]) <= names.MAX_SET_NAME
    # <set>-<group>-<worker> pods and the <set>-<group>-<10-char hash> revision label.
    assert len(lws["metadata"]["name"]) + len("-999-") + 10 <= 63
    assert all(len(o["metadata"]["name"]) <= 63 for o in objects)
