"""Multi-node replicas on the real API server, with LeaderWorkerSet's API installed
(e2e/crds/leaderworkerset.yaml; the tests play its controller): every object the multi-node
examples plan is one the server accepts, and each LeaderWorkerSet's pod templates are pods the
server accepts, as its controller would create them."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from e2e.chart_support import apply
from fleetpilot.api import InferenceService, parse_service
from fleetpilot.autoscaler.actuator import AutoscalerMetrics, KubernetesActuator, Replicas
from fleetpilot.kube import names
from fleetpilot.kube.client import RESOURCES, Kube, Obj
from fleetpilot.kube.managers import AUTOSCALER_MANAGER, OPERATOR_MANAGER
from fleetpilot.operator.plan_types import PlanOptions
from fleetpilot.operator.planner import all_roles, plan
from fleetpilot.operator.reconcile import settle_replicas

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MULTI_NODE_EXAMPLES = ["deepseek-wide-ep.yaml", "llama-405b-multinode.yaml"]
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


def _manifest_of(example: str) -> Obj:
    manifest: Obj = yaml.safe_load((EXAMPLES / example).read_text())
    return manifest


def example_in(namespace: str, example: str) -> InferenceService:
    manifest = _manifest_of(example)
    manifest["metadata"]["namespace"] = namespace
    return parse_service(manifest)


def group_pod(lws: Obj, template: Obj, worker: int) -> Obj:
    """The pod the LWS controller makes of a template for group 0: its name, the labels and
    the variables it adds (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX)."""
    name = lws["metadata"]["name"]
    namespace = lws["metadata"]["namespace"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    pod = copy.deepcopy(template)
    meta = pod.setdefault("metadata", {})
    meta["name"] = f"{name}-0" if worker == 0 else f"{name}-0-{worker}"
    meta["namespace"] = namespace
    meta["labels"] = {
        **meta.get("labels", {}),
        names.LWS_WORKER_INDEX_LABEL: str(worker),
        SET_NAME_LABEL: name,
        "leaderworkerset.sigs.k8s.io/group-index": "0",
    }
    injected = [
        {"name": "LWS_LEADER_ADDRESS", "value": f"{name}-0.{name}.{namespace}"},
        {"name": "LWS_GROUP_SIZE", "value": str(size)},
        {"name": "LWS_WORKER_INDEX", "value": str(worker)},
    ]
    for container in pod["spec"]["containers"]:
        container["env"] = [*injected, *container.get("env", [])]
    pod["spec"]["hostname"] = meta["name"]
    pod["spec"]["subdomain"] = name
    return {"apiVersion": "v1", "kind": "Pod", **pod}


@pytest.mark.parametrize("example", MULTI_NODE_EXAMPLES)
def test_every_planned_object_and_group_pod_is_accepted(
    kube: Kube, namespace: str, chart_crds: None, leader_worker_set_crd: None, example: str
) -> None:
    """Server-side apply (dry run, strict fields) of every object of the example, the
    LeaderWorkerSets included; then each set's leader and worker pods of group 0 created
    (dry run) as the controller would, so the pod templates meet the real Pod schema."""
    service = example_in(namespace, example)
    objects = plan(service, PlanOptions())
    sets = []
    for obj in objects:
        meta = obj["metadata"]
        # The engines' ServiceAccount for real: pod admission looks it up, and a dry run
        # leaves none for the group pods below.
        accepted = apply(
            kube,
            RESOURCES[obj["kind"]].path(namespace, meta["name"]),
            obj,
            dry_run=obj["kind"] != "ServiceAccount",
        )
        if obj["kind"] == "LeaderWorkerSet":
            # Nothing the planner set was dropped or defaulted away by the schema.
            assert (
                accepted["spec"]["leaderWorkerTemplate"]["size"]
                == obj["spec"]["leaderWorkerTemplate"]["size"]
            )
            assert accepted["spec"]["startupPolicy"] == "LeaderCreated"
            rolling = accepted["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
            assert rolling | {"partition": 0} == rolling  # the server's default, nothing else
            assert {"maxSurge": 1, "maxUnavailable": 0}.items() <= rolling.items()
            sets.append(accepted)
    multi_node = [role for role in all_roles(service) if names.spans_nodes(role)]
    assert len(sets) == len(multi_node) >= 1
    for lws in sets:
        template = lws["spec"]["leaderWorkerTemplate"]
        size = template["size"]
        pods = [group_pod(lws, template["leaderTemplate"], 0)]
        pods += [group_pod(lws, template["workerTemplate"], i) for i in range(1, size)]
        for pod in pods:
            created = kube.request(
                "POST",
                RESOURCES["Pod"].path(namespace),
                query=[("dryRun", "All"), ("fieldValidation", "Strict")],
                body=pod,
            )
            assert created["metadata"]["name"] == pod["metadata"]["name"]


def _owners_of_replicas(obj: Obj) -> set[str]:
    """Managers whose managedFields entry holds spec.replicas."""
    owners = set()
    for entry in obj["metadata"].get("managedFields", []):
        if "f:replicas" in entry.get("fieldsV1", {}).get("f:spec", {}):
            owners.add(entry["manager"])
    return owners


def test_the_autoscaler_scales_groups_through_the_scale_subresource(
    kube: Kube, namespace: str, chart_crds: None, leader_worker_set_crd: None
) -> None:
    """The set applied as the operator applies it; the autoscaler's actuator reads its groups
    (replicas and ready, from the status the controller writes) and scales it through /scale,
    which leaves spec.replicas to the autoscaler alone: the operator's next apply of the
    same set (replicas settled as the reconciler does) does not reset it."""
    manifest = _manifest_of("llama-405b-multinode.yaml")
    manifest["metadata"]["namespace"] = namespace
    live = kube.apply(manifest, "e2e-test")
    service = parse_service(live)
    (lws,) = [o for o in plan(service) if o["kind"] == "LeaderWorkerSet"]
    kube.apply(lws, OPERATOR_MANAGER)
    name = lws["metadata"]["name"]
    # The controller's part: one group created and Ready, the leaders' selector for /scale.
    kube.patch_status(
        "LeaderWorkerSet",
        namespace,
        name,
        {
            "replicas": 1,
            "readyReplicas": 1,
            "updatedReplicas": 1,
            "hpaPodSelector": f"{names.LWS_WORKER_INDEX_LABEL}=0,{SET_NAME_LABEL}={name}",
        },
        "e2e-lws-controller",
    )
    actuator = KubernetesActuator(kube, metrics=AutoscalerMetrics(CollectorRegistry()))
    assert actuator.current(service, "main", "unified") == Replicas(current=1, ready=1)

    actuator.scale(service, "main", "unified", 3)
    scaled = kube.get("LeaderWorkerSet", namespace, name)
    assert scaled is not None
    assert scaled["spec"]["replicas"] == 3
    assert _owners_of_replicas(scaled) == {AUTOSCALER_MANAGER}
    scale = kube.request("GET", RESOURCES["LeaderWorkerSet"].path(namespace, name) + "/scale")
    assert scale["spec"]["replicas"] == 3
    assert scale["status"]["selector"].startswith(names.LWS_WORKER_INDEX_LABEL)
    assert actuator.current(service, "main", "unified") == Replicas(current=3, ready=1)

    reapplied = kube.apply(settle_replicas(lws, scaled, autoscaled=True), OPERATOR_MANAGER)
    assert reapplied["spec"]["replicas"] == 3
