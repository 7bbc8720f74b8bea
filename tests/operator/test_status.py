"""compute_status: Ready only when it is true, Degraded with the reason a person needs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from fleetpilot.api import InferenceService
from fleetpilot.api.capacity import role_capacity
from fleetpilot.api.status import Condition, InferenceServiceStatus, RoleStatus, TierStatus
from fleetpilot.operator.plan_types import LEADER_WORKER_SET_MISSING, Refusal
from fleetpilot.operator.status import Observed, compute_status
from tests.factories import make_service, make_tier
from tests.support.argocd import CUSTOMIZATION, argocd_health
from tests.support.kstatus import kstatus

NOW = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)


def _deployment(
    name: str, replicas: int = 1, ready: int = 1, generation: int = 1, **st: Any
) -> Any:
    status = {
        "observedGeneration": generation,
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": ready,
        **st,
    }
    return {
        "metadata": {"name": name, "generation": generation},
        "spec": {"replicas": replicas},
        "status": status,
    }


@pytest.fixture
def service() -> InferenceService:
    svc = make_service()
    return svc.model_copy(update={"metadata": svc.metadata.model_copy(update={"generation": 4})})


def _conditions(status: InferenceServiceStatus) -> dict[str, Condition]:
    return {c.type: c for c in status.conditions}


def _observed(*workloads: Any, pods: list[Any] | None = None) -> Observed:
    """Workloads are Deployments unless they say their kind."""
    keys = [(w.get("kind", "Deployment"), w["metadata"]["name"]) for w in workloads]
    return Observed(dict(zip(keys, workloads, strict=True)), pods or [])


def test_ready_when_every_deployment_is_rolled_out(service: InferenceService) -> None:
    """Every planned Deployment at the latest spec with all replicas ready: Ready True, no
    rollout, no problem, and every condition stamped with the generation it was computed
    from."""
    observed = _observed(_deployment("chat-small"), _deployment("chat-router", 2, 2))
    status = compute_status(service, observed, None, NOW)
    conditions = _conditions(status)
    assert conditions["Ready"].status == "True"
    assert conditions["Progressing"].status == "False"
    assert conditions["Degraded"].status == "False"
    assert {c.observed_generation for c in status.conditions} == {4}
    assert status.observed_generation == 4
    assert status.tiers_ready == "1/1"
    assert status.tiers == [
        TierStatus(name="small", roles=[RoleStatus(role="unified", replicas=1, ready=1)])
    ]


def test_not_ready_while_a_replica_is_not(service: InferenceService) -> None:
    """One replica of two not ready: Ready False saying which role waits for what, the tier
    not counted ready, and Progressing True."""
    observed = _observed(_deployment("chat-small", 2, 1), _deployment("chat-router"))
    conditions = _conditions(compute_status(service, observed, None, NOW))
    assert conditions["Ready"].status == "False"
    assert conditions["Ready"].message == "tier small role unified: 1/2 ready"
    assert compute_status(service, observed, None, NOW).tiers_ready == "0/1"
    assert conditions["Progressing"].status == "True"


def test_not_ready_before_the_controller_saw_the_new_generation(
    service: InferenceService,
) -> None:
    """The classic too-early Ready: old pods ready, new spec not yet observed."""
    stale = _deployment("chat-small", generation=2)
    stale["metadata"]["generation"] = 3
    conditions = _conditions(
        compute_status(service, _observed(stale, _deployment("chat-router")), None, NOW)
    )
    assert conditions["Ready"].status == "False"


def test_missing_deployment_is_not_ready(service: InferenceService) -> None:
    """A planned Deployment that does not exist (yet) is not ready: created is not Ready."""
    conditions = _conditions(
        compute_status(service, _observed(_deployment("chat-router")), None, NOW)
    )
    assert conditions["Ready"].status == "False"


@pytest.mark.parametrize(
    ("pod_status", "reason"),
    [
        (
            {"containerStatuses": [{"state": {"waiting": {"reason": "CrashLoopBackOff"}}}]},
            "CrashLooping",
        ),
        (
            {"containerStatuses": [{"state": {"waiting": {"reason": "ErrImagePull"}}}]},
            "ImagePullFailing",
        ),
        (
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                    }
                ]
            },
            "Unschedulable",
        ),
    ],
)
def test_degraded_names_the_pod_problem(
    service: InferenceService, pod_status: dict[str, Any], reason: str
) -> None:
    """Crash loops, failing image pulls and unschedulable pods make Degraded True with a
    reason of their own and the pod named, so no one has to dig it out of the pods."""
    pod = {"metadata": {"name": "chat-small-abc"}, "status": pod_status}
    observed = _observed(_deployment("chat-small", 1, 0), _deployment("chat-router"), pods=[pod])
    degraded = _conditions(compute_status(service, observed, None, NOW))["Degraded"]
    assert degraded.status == "True"
    assert degraded.reason == reason
    assert "chat-small-abc" in degraded.message


def test_stuck_rollout_is_degraded(service: InferenceService) -> None:
    """A rollout past its progress deadline is Degraded RolloutStuck."""
    stuck = _deployment(
        "chat-small",
        1,
        0,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "ReplicaSet has timed out progressing.",
            }
        ],
    )
    degraded = _conditions(
        compute_status(service, _observed(stuck, _deployment("chat-router")), None, NOW)
    )["Degraded"]
    assert degraded.reason == "RolloutStuck"


def test_refused_plan_is_degraded_and_not_ready(service: InferenceService) -> None:
    """A plan the operator refused: Degraded and Ready both say PlanRefused, with the
    planner's words."""
    status = compute_status(service, _observed(), None, NOW, Refusal("spec.x: bad"))
    conditions = _conditions(status)
    assert conditions["Degraded"].reason == "PlanRefused"
    assert conditions["Degraded"].message == "spec.x: bad"
    assert conditions["Ready"].reason == "PlanRefused"


# A replica of 8 GPUs on nodes of 4: tier big's role runs as a LeaderWorkerSet of 2-pod groups.
MULTI_NODE = {"parallelism": {"tensor": 4, "pipeline": 2}, "resources": {"gpusPerNode": 4}}


def _leader_worker_set(name: str, groups: int, ready: int, **st: Any) -> Any:
    """A LeaderWorkerSet as its controller reports it: a Deployment's fields, counting groups."""
    return dict(_deployment(name, groups, ready, **st), kind="LeaderWorkerSet")


def test_a_multi_node_roles_replicas_are_its_leader_worker_sets_groups() -> None:
    """A role whose replicas span nodes reads its rollout from its LeaderWorkerSet: replicas
    and ready count groups (two groups of two pods: 2, not 4), under the same label - never
    from a Deployment of the same name left from before the role spanned nodes."""
    service = make_service(tiers=[make_tier("small", up_to=0.4), make_tier("big", **MULTI_NODE)])
    progressing = [
        {"type": "Progressing", "status": "True", "reason": "GroupsAreProgressing",
         "message": "Replicas are progressing"},
    ]  # fmt: skip
    workloads = [
        _deployment("chat-small"),
        _deployment("chat-router"),
        _deployment("chat-big", 4, 4),  # the role's old Deployment, being pruned
    ]
    one_ready = _observed(*workloads, _leader_worker_set("chat-big", 2, 1, conditions=progressing))
    status = compute_status(service, one_ready, None, NOW)
    conditions = _conditions(status)
    assert status.tiers[1] == TierStatus(
        name="big", roles=[RoleStatus(role="unified", replicas=2, ready=1)]
    )
    assert conditions["Ready"].status == "False"
    assert conditions["Ready"].message == "tier big role unified: 1/2 ready"
    assert conditions["Progressing"].message == "rolling out: tier big role unified"
    # Groups coming up is no problem.
    assert conditions["Degraded"].status == "False"

    both_ready = _observed(*workloads, _leader_worker_set("chat-big", 2, 2))
    status = compute_status(service, both_ready, None, NOW)
    assert _conditions(status)["Ready"].status == "True"
    assert status.tiers_ready == "2/2"


def test_a_missing_leader_worker_set_api_stalls_the_service_naming_it(
    service: InferenceService,
) -> None:
    """A multi-node role in a cluster without LeaderWorkerSet: Ready False, Degraded and
    Stalled True, all with the refusal's own reason and the planner's words."""
    message = (
        "spec.tiers[0].parallelism: tier 'small' role unified needs 2 nodes per replica ... "
        "install LeaderWorkerSet (https://lws.sigs.k8s.io) and restart the operator"
    )
    refusal = Refusal(message, LEADER_WORKER_SET_MISSING)
    conditions = _conditions(compute_status(service, _observed(), None, NOW, refusal))
    for kind, state in [("Ready", "False"), ("Degraded", "True"), ("Stalled", "True")]:
        assert (conditions[kind].status, conditions[kind].reason) == (
            state,
            "LeaderWorkerSetMissing",
        ), kind
        assert conditions[kind].message == message, kind
    assert conditions["Reconciling"].status == "False"


def test_transition_time_moves_only_when_status_flips(service: InferenceService) -> None:
    """lastTransitionTime says since when: kept while Ready holds, moved when it flips."""
    ready = _observed(_deployment("chat-small"), _deployment("chat-router"))
    first = compute_status(service, ready, None, NOW)
    later = NOW + timedelta(minutes=5)
    again = compute_status(service, ready, first, later)
    assert _conditions(again)["Ready"].last_transition_time == NOW
    flipped = compute_status(service, _observed(_deployment("chat-router")), again, later)
    assert _conditions(flipped)["Ready"].last_transition_time == later


def test_autoscaler_fields_are_kept(service: InferenceService) -> None:
    """Status refreshes must not erase what the autoscaler recorded."""
    previous = InferenceServiceStatus.model_validate(
        {
            "conditions": [
                {
                    "type": "ScalingActive",
                    "status": "True",
                    "reason": "FreshMetrics",
                    "lastTransitionTime": "2026-11-29T09:00:00Z",
                }
            ],
            "tiers": [
                {
                    "name": "small",
                    "roles": [
                        {
                            "role": "unified",
                            "desired": 3,
                            "lastScale": {
                                "time": "2026-11-29T09:00:00Z",
                                "fromReplicas": 1,
                                "toReplicas": 3,
                                "reason": "ttft p95 1.2s > slo 800ms: 1 -> 3",
                            },
                        }
                    ],
                }
            ],
        }
    )
    observed = _observed(_deployment("chat-small"), _deployment("chat-router"))
    status = compute_status(service, observed, previous, NOW)
    assert _conditions(status)["ScalingActive"] == previous.conditions[0]
    role = status.tiers[0].roles[0]
    assert role.desired == 3
    assert role.last_scale is not None
    assert role.last_scale.to_replicas == 3


def test_tiers_ready_counts_tiers_not_roles() -> None:
    """A disaggregated tier is ready only when both its roles are; the router is no tier."""
    from tests.factories import make_tier

    two = make_service(
        tiers=[make_tier("small", up_to=0.3), make_tier("large", mode="disaggregated")]
    )
    observed = _observed(
        _deployment("chat-small"),
        _deployment("chat-large-prefill"),
        _deployment("chat-large-decode", 2, 1),
        _deployment("chat-router", 1, 0),
    )
    assert compute_status(two, observed, None, NOW).tiers_ready == "1/2"


@pytest.mark.parametrize(
    ("model", "engine", "status", "reason", "words"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", {}, "True", "Sized",
         "holds its maxModelLen and maxNumSeqs"),
        # Two H100s leave ~26k tokens of KV: three 8k sequences, far from 512.
        ("meta-llama/Llama-3.1-70B-Instruct", {"maxNumSeqs": 512}, "False", "CapacityWarning",
         "maxNumSeqs 512 is over 32x the 3 sequences"),
        ("acme/secret-13b", {}, "Unknown", "NotSized", "not sized: tier small / unified"),
    ],
)  # fmt: skip
def test_capacity_sufficient_says_what_the_planner_computed(
    model: str, engine: dict[str, Any], status: str, reason: str, words: str
) -> None:
    """CapacitySufficient: True for a role whose KV cache holds what the spec asks, False with
    the planner's warning for one whose batch limit it cannot fill, Unknown naming a role of
    a model the planner does not know (the same numbers as `fleetpilot plan -o summary`)."""
    tier = make_tier(
        model=model,
        tensor=2,
        engine=engine,
        resources={"gpuProduct": "NVIDIA-H100-80GB-HBM3"},
    )
    tier["model"]["maxModelLen"] = 8192
    svc = make_service(tiers=[tier])
    capacity = _conditions(compute_status(svc, _observed(), None, NOW))["CapacitySufficient"]
    assert (capacity.status, capacity.reason) == (status, reason)
    assert words in capacity.message


def test_a_reference_tier_is_not_sized_as_a_gpu_model() -> None:
    """A reference tier runs a seeded CPU model whatever model name and GPU product its spec
    carries: it is not sized as that model on that GPU (no false warning, no advice to set
    an architecture), and CapacitySufficient does not report it as unsized."""
    tier = make_tier(
        model="meta-llama/Llama-3.1-70B-Instruct",
        engine={"backend": "reference", "maxNumSeqs": 512},
        resources={"gpuProduct": "NVIDIA-H100-80GB-HBM3"},
    )
    svc = make_service(tiers=[tier])
    assert role_capacity(svc.spec.tiers[0].roles()[0]) is None
    capacity = _conditions(compute_status(svc, _observed(), None, NOW))["CapacitySufficient"]
    assert "not sized" not in capacity.message
    assert capacity.reason == "Sized"


def _as_written(service: InferenceService, status: InferenceServiceStatus) -> dict[str, Any]:
    """The object as the API server would return it after the operator's status write."""
    return {
        "apiVersion": "fleetpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": service.name, "generation": service.metadata.generation},
        "status": status.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


_STUCK = [
    {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "chat-small-6d4" has timed out progressing.',
    }
]
_QUOTA = [
    {
        "type": "ReplicaFailure",
        "status": "True",
        "reason": "FailedCreate",
        "message": 'pods "chat-small-x" is forbidden: exceeded quota: no-pods',
    }
]


_CRASH = {
    "metadata": {"name": "chat-small-abc"},
    "status": {"containerStatuses": [{"state": {"waiting": {"reason": "CrashLoopBackOff"}}}]},
}
# Each phase of a service's life: (what the cluster shows, the planner's refusal).
PHASES: dict[str, tuple[Observed, Refusal | None]] = {
    "ready": (_observed(_deployment("chat-small"), _deployment("chat-router")), None),
    "rolling out": (_observed(_deployment("chat-small", 2, 1), _deployment("chat-router")), None),
    "refused": (_observed(), Refusal("spec.tiers[0].engine.extraArgs[0]: --port is set")),
    "no LeaderWorkerSet": (
        _observed(),
        Refusal(
            "spec.tiers[0].parallelism: tier 'small' role unified needs 2 nodes per replica",
            LEADER_WORKER_SET_MISSING,
        ),
    ),
    "stuck": (
        _observed(_deployment("chat-small", 1, 0, conditions=_STUCK), _deployment("chat-router")),
        None,
    ),
    "quota": (
        _observed(_deployment("chat-small", 1, 0, conditions=_QUOTA), _deployment("chat-router")),
        None,
    ),
    "crash looping mid-rollout": (
        _observed(_deployment("chat-small", 1, 0), _deployment("chat-router"), pods=[_CRASH]),
        None,
    ),
}


@pytest.mark.parametrize(
    ("case", "kstatus_status", "reconciling", "stalled"),
    [
        ("ready", "Current", "False", "False"),
        ("rolling out", "InProgress", "True", "False"),
        ("refused", "Failed", "False", "True"),
        ("no LeaderWorkerSet", "Failed", "False", "True"),
        ("stuck", "Failed", "False", "True"),
        ("quota", "Failed", "False", "True"),
        ("crash looping mid-rollout", "InProgress", "True", "False"),
    ],
)
def test_flux_kstatus_reads_each_phase_right(
    service: InferenceService, case: str, kstatus_status: str, reconciling: str, stalled: str
) -> None:
    """Reconciling and Stalled are what Flux's kstatus reads on a custom resource: the real
    library (cli-utils, pinned) says InProgress while a rollout is under way, Current when
    ready, Failed on a refused plan or a rollout that cannot finish - never both True."""
    observed, refusal = PHASES[case]
    status = compute_status(service, observed, None, NOW, refusal)
    conditions = _conditions(status)
    assert conditions["Reconciling"].status == reconciling
    assert conditions["Stalled"].status == stalled
    assert conditions["Reconciling"].status == conditions["Progressing"].status
    (computed,) = kstatus([_as_written(service, status)])
    assert computed["status"] == kstatus_status, computed
    if stalled == "True":
        assert computed["message"] == conditions["Stalled"].message


@pytest.mark.parametrize(
    ("case", "health"),
    [
        ("ready", "Healthy"),
        ("rolling out", "Progressing"),
        ("refused", "Degraded"),
        ("no LeaderWorkerSet", "Degraded"),
        ("stuck", "Degraded"),
        ("quota", "Degraded"),
        ("crash looping mid-rollout", "Progressing"),
    ],
)
def test_argocd_health_lua_reads_each_phase_right(
    service: InferenceService, case: str, health: str
) -> None:
    """The shipped health.lua, in a real Lua 5.1 as Argo CD runs it, over each phase."""
    observed, refusal = PHASES[case]
    status = compute_status(service, observed, None, NOW, refusal)
    result = argocd_health(_as_written(service, status))
    assert result["status"] == health, result
    if health == "Degraded":
        assert _conditions(status)["Stalled"].message in result["message"]


def test_argocd_health_waits_for_a_status_of_the_latest_spec(service: InferenceService) -> None:
    """No status yet, or one computed from an older generation, is Progressing - never the
    old Healthy (the window right after an apply, before the operator has written)."""
    written = _as_written(service, compute_status(service, PHASES["ready"][0], None, NOW))
    assert argocd_health(written)["status"] == "Healthy"
    assert argocd_health({**written, "status": None})["status"] == "Progressing"
    newer = {**written, "metadata": {**written["metadata"], "generation": 5}}
    assert argocd_health(newer) == {
        "status": "Progressing",
        "message": "Waiting for the operator to see generation 5",
    }


def test_argocd_health_test_cases_pass() -> None:
    """health_test.yaml, in the layout of Argo CD's resource_customizations, passes."""
    cases = yaml.safe_load((CUSTOMIZATION / "health_test.yaml").read_text())["tests"]
    assert len(cases) >= 5
    for case in cases:
        obj = yaml.safe_load((CUSTOMIZATION / case["inputPath"]).read_text())
        assert argocd_health(obj) == case["healthStatus"], case["inputPath"]


def _was_ready(service: InferenceService) -> InferenceServiceStatus:
    observed = _observed(_deployment("chat-small", 2, 2), _deployment("chat-router", 2, 2))
    status = compute_status(service, observed, None, NOW)
    assert _conditions(status)["Ready"].status == "True"
    return status


def test_a_ready_service_stays_ready_one_replica_short(service: InferenceService) -> None:
    """A pod evicted by a drain (or crashed) and being replaced: the role at the latest spec
    with one of two ready is what its disruption budget allows. The service still serves:
    Ready stays True, its reason and message say which replica is missing, the tier counts."""
    previous = _was_ready(service)
    for short in (
        _observed(_deployment("chat-small", 2, 1), _deployment("chat-router", 2, 2)),
        _observed(_deployment("chat-small", 2, 2), _deployment("chat-router", 2, 1)),
        _observed(_deployment("chat-small", 3, 2), _deployment("chat-router", 2, 2)),  # scale-up
        # Evicted, its replacement not made yet: the pod has left every count.
        _observed(_reporting(replicas=1, updatedReplicas=1), _deployment("chat-router", 2, 2)),
    ):
        status = compute_status(service, short, previous, NOW)
        ready = _conditions(status)["Ready"]
        assert (ready.status, ready.reason) == ("True", "WithinDisruptionBudget")
        assert "1/2 ready" in ready.message or "2/3 ready" in ready.message
        assert status.tiers_ready == "1/1"


def _reporting(**status: int) -> Any:
    """The small role's Deployment (2 wanted, 1 ready) with these status fields."""
    deployment = _deployment("chat-small", 2, 1)
    deployment["status"].update(status)
    return deployment


@pytest.mark.parametrize(
    ("small", "why"),
    [
        (_deployment("chat-small", 2, 0), "no replica ready"),
        (_deployment("chat-small", 3, 1), "two replicas short"),
        (_deployment("chat-small", 1, 0), "the only replica gone"),
        # The last step of a rollout: every new pod made, an old one still there.
        (_reporting(replicas=3), "an older pod left"),
        (_reporting(updatedReplicas=1), "the new spec half rolled out"),
        (_reporting(observedGeneration=0), "the new spec not seen"),
    ],
)
def test_a_ready_service_leaves_ready_beyond_its_budget(
    service: InferenceService, small: Any, why: str
) -> None:
    """Past what a disruption budget allows, or before the latest spec is rolled out,
    Ready goes False as for a service that never was."""
    previous = _was_ready(service)
    observed = _observed(small, _deployment("chat-router", 2, 2))
    ready = _conditions(compute_status(service, observed, previous, NOW))["Ready"]
    assert (ready.status, ready.reason) == ("False", "ReplicasNotReady"), why
