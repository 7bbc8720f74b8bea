"""The watched children: what an index keeps of a Deployment or pod is all the status reads."""

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
from tests.factories import make_service

NOW = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)


@pytest.fixture
def service() -> InferenceService:
    return make_service()


def _live_deployments(service: InferenceService, ready: int) -> list[Obj]:
    """The planned Deployments as the API server returns them: managedFields, the whole pod
    template, a status with conditions."""
    live = []
    for obj in plan(service):
        if obj["kind"] != "Deployment":
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
    deployments, pods = _live_deployments(service, ready), _pods(service)
    listed = Observed({d["metadata"]["name"]: d for d in deployments}, pods)
    children = Children()
    children.attach(_index("Deployment", deployments), _index("Pod", pods))
    watched = children.observed(service.namespace, service.name)
    assert watched is not None
    status = compute_status(service, watched, None, NOW)
    assert status == compute_status(service, listed, None, NOW)
    # ... the started engine's cold start included (its labels and timestamps are kept) ...
    cold_start = status.tiers[0].roles[0].cold_start
    # (and the one being deleted left out).
    assert cold_start is not None
    assert [s.pod for s in cold_start.samples] == ["started"]
    assert cold_start.start.max_seconds == 42
    assert cold_start.pod is not None
    assert cold_start.pod.max_seconds == 102
    # ... and it is small: none of the template, managedFields or owner references.
    for entry in [*watched.deployments.values(), *watched.pods]:
        if entry["kind"] == "Deployment":
            assert set(entry["metadata"]) == {"name", "generation"}
        else:
            kept = {"name", "labels", "creationTimestamp", "deletionTimestamp"}
            assert {"name", "labels", "creationTimestamp"} <= set(entry["metadata"]) <= kept
            assert set(entry["metadata"]["labels"]) == {names.LABEL_TIER, names.LABEL_ROLE}
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
