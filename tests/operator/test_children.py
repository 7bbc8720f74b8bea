"""The watched children: what an index keeps of a workload (Deployment, LeaderWorkerSet) or pod
is all the status reads."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from fleetpilot.api import InferenceService
from fleetpilot.kube import names
from fleetpilot.kube.client import Obj
from fleetpilot.operator.children import Children, index_entry
from fleetpilot.operator.planner import plan
from fleetpilot.operator.status import Observed, compute_status
from tests.factories import make_service, make_tier

NOW = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
# A replica of 8 GPUs on nodes of 4: the tier's role runs as a LeaderWorkerSet.
MULTI_NODE = {"parallelism": {"tensor": 4, "pipeline": 2}, "resources": {"gpusPerNode": 4}}


@pytest.fixture
def service() -> InferenceService:
    return make_service(tiers=[make_tier("small", up_to=0.4), make_tier("big", **MULTI_NODE)])


def _live_workloads(service: InferenceService, ready: int, kind: str) -> list[Obj]:
    """The planned workloads of ``kind`` as the API server returns them: managedFields, the
    whole pod template(s), a status with conditions."""
    live = []
    for obj in plan(service):
        if obj["kind"] != kind:
            continue
        body = copy.deepcopy(obj)
        replicas = body["spec"].get("replicas", 1)
        body["metadata"].update(
            generation=2,
            resourceVersion="812",
            uid="d-uid",
            managedFields=[{"manager": "fleetpilot", "fieldsV1": {"f:spec": {}}}],
        )
        body["status"] = {
            "observedGeneration": 2,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": min(ready, replicas),
            "conditions": [
                {
                    "type": "Progressing",
                    "status": "False",
                    "reason": "ProgressDeadlineExceeded",
                    "message": "ReplicaSet has timed out progressing.",
                }
            ],
        }
        live.append(body)
    return live


def _live_pod(service: InferenceService, name: str, **status: Any) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": service.namespace,
            "creationTimestamp": "2026-12-03T09:58:00Z",
            "labels": {
                names.LABEL_SERVICE: service.name,
                names.LABEL_TIER: "small",
                names.LABEL_ROLE: "unified",
                "pod-template-hash": "abc",
            },
            "ownerReferences": [{"kind": "ReplicaSet", "name": "rs", "uid": "rs-uid"}],
            "managedFields": [{"manager": "kube-controller-manager"}],
        },
        "spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai"}]},
        "status": status,
    }


def _pods(service: InferenceService) -> list[Obj]:
    ready = [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-03T09:59:42Z"}]
    running = [
        {
            "name": "engine",
            "restartCount": 0,
            "state": {"running": {"startedAt": "2026-12-03T09:59:00Z"}},
        }
    ]
    stopping = _live_pod(
        service, "stopping", phase="Running", conditions=ready, containerStatuses=running
    )
    stopping["metadata"]["deletionTimestamp"] = "2026-12-03T09:59:50Z"
    return [
        _live_pod(service, "started", phase="Running", conditions=ready, containerStatuses=running),
        stopping,
        _live_pod(
            service,
            "crashing",
            phase="Running",
            containerStatuses=[
                {
                    "name": "engine",
                    "restartCount": 7,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                }
            ],
        ),
        _live_pod(
            service,
            "pending",
            phase="Pending",
            conditions=[
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                }
            ],
        ),
    ]


def _index(kind: str, objects: list[Obj]) -> dict[tuple[str, str], list[Obj]]:
    """An index as kopf keeps it: per service key, the entries of its objects."""
    index: dict[tuple[str, str], list[Obj]] = {}
    for obj in objects:
        for key, entry in index_entry(kind, obj).items():
            index.setdefault(key, []).append(entry)
    return index


@pytest.mark.parametrize("ready", [0, 1])
def test_the_status_from_the_index_is_the_status_from_the_listed_objects(
    service: InferenceService, ready: int
) -> None:
    deployments, pods = _live_workloads(service, ready, "Deployment"), _pods(service)
    leader_worker_sets = _live_workloads(service, ready, "LeaderWorkerSet")
    workloads = deployments + leader_worker_sets
    listed = Observed({(w["kind"], w["metadata"]["name"]): w for w in workloads}, pods)
    children = Children()
    children.attach(
        _index("Deployment", deployments),
        _index("Pod", pods),
        _index("LeaderWorkerSet", leader_worker_sets),
    )
    watched = children.observed(service.namespace, service.name)
    assert watched is not None
    assert set(watched.workloads) == {
        ("Deployment", "chat-small"),
        ("Deployment", "chat-router"),
        ("LeaderWorkerSet", "chat-big"),
    }
    status = compute_status(service, watched, None, NOW)
    assert status == compute_status(service, listed, None, NOW)
    # The multi-node role's replicas read from its LeaderWorkerSet.
    (big,) = status.tiers[1].roles
    assert (big.replicas, big.ready) == (1, min(ready, 1))
    # ... the started engine's cold start included (its labels and timestamps are kept) ...
    cold_start = status.tiers[0].roles[0].cold_start
    # (and the one being deleted left out).
    assert cold_start is not None
    assert [s.pod for s in cold_start.samples] == ["started"]
    assert cold_start.start.max_seconds == 42
    assert cold_start.pod is not None
    assert cold_start.pod.max_seconds == 102
    # ... and it is small: none of the template, managedFields or owner references.
    for entry in [*watched.workloads.values(), *watched.pods]:
        if entry["kind"] in ("Deployment", "LeaderWorkerSet"):
            assert set(entry["metadata"]) == {"name", "generation"}
        else:
            kept = {"name", "labels", "creationTimestamp", "deletionTimestamp"}
            assert {"name", "labels", "creationTimestamp"} <= set(entry["metadata"]) <= kept
            assert set(entry["metadata"]["labels"]) == {names.LABEL_TIER, names.LABEL_ROLE}
            # (a group's pods keep their worker index too: the test below)
        assert "template" not in entry.get("spec", {})


def test_an_object_of_no_service_is_not_indexed(service: InferenceService) -> None:
    pod = _live_pod(service, "stray")
    del pod["metadata"]["labels"][names.LABEL_SERVICE]
    assert index_entry("Pod", pod) == {}


def test_before_kopf_hands_over_the_indexes_the_caller_lists(service: InferenceService) -> None:
    children = Children()
    assert children.observed(service.namespace, service.name) is None
    children.attach({}, {})
    assert children.observed(service.namespace, service.name) == Observed({}, [])


def test_without_the_leader_worker_set_index_a_service_has_only_deployments(
    service: InferenceService,
) -> None:
    """Where the cluster serves no LeaderWorkerSet, kopf hands over no such index (none is
    registered): the watched workloads are the Deployments, and nothing fails."""
    deployments = _live_workloads(service, 1, "Deployment")
    children = Children()
    children.attach(_index("Deployment", deployments), {})
    watched = children.observed(service.namespace, service.name)
    assert watched is not None
    assert {kind for kind, _ in watched.workloads} == {"Deployment"}


def test_a_deployment_left_from_before_a_role_spanned_nodes_is_not_its_rollout(
    service: InferenceService,
) -> None:
    """A role that turns multi-node gets a LeaderWorkerSet named as its old Deployment, and
    both are watched until the Deployment is pruned: the role's replicas are the set's
    groups, not the old Deployment's pods."""
    (leader_worker_set,) = _live_workloads(service, 0, "LeaderWorkerSet")
    old = copy.deepcopy(_live_workloads(make_service(), 1, "Deployment")[0])
    old["metadata"]["name"] = leader_worker_set["metadata"]["name"]
    old["spec"]["replicas"] = old["status"]["readyReplicas"] = 4
    children = Children()
    children.attach(_index("Deployment", [old]), {}, _index("LeaderWorkerSet", [leader_worker_set]))
    watched = children.observed(service.namespace, service.name)
    assert watched is not None
    assert len(watched.workloads) == 2
    (big,) = compute_status(service, watched, None, NOW).tiers[1].roles
    assert (big.replicas, big.ready) == (1, 0)


def test_a_multi_node_groups_worker_pods_count_as_they_do_listed(
    service: InferenceService,
) -> None:
    """The pods of a LeaderWorkerSet group carry the worker-index label (0 on the leader),
    which the cold-start samples read: the index keeps it, so the watched status is the listed
    one with a group's pods in it."""
    ready = [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-03T09:59:42Z"}]
    running = [
        {
            "name": "engine",
            "restartCount": 0,
            "state": {"running": {"startedAt": "2026-12-03T09:59:00Z"}},
        }
    ]
    group = []
    for worker in (0, 1):
        pod = _live_pod(
            service, f"chat-big-0-{worker}", phase="Running", conditions=ready,
            containerStatuses=running,
        )  # fmt: skip
        pod["metadata"]["labels"] |= {
            names.LABEL_TIER: "big",
            names.LWS_WORKER_INDEX_LABEL: str(worker),
        }
        group.append(pod)
    children = Children()
    children.attach({}, _index("Pod", group), {})
    watched = children.observed(service.namespace, service.name)
    assert watched is not None
    kept = [entry["metadata"]["labels"].get(names.LWS_WORKER_INDEX_LABEL) for entry in watched.pods]
    assert kept == ["0", "1"]
    listed = Observed({}, group)
    assert compute_status(service, watched, None, NOW) == compute_status(service, listed, None, NOW)
