"""The actuator: scale subresource, status records, the ScalingActive condition, Events.

KubernetesActuator runs against the in-memory API server of ``tests/support/kube.py``, which
keeps real objects (an InferenceService from the factories, its status as the operator writes
it, a Deployment), applies JSON merge patches (RFC 7386) and honours the resourceVersion
precondition with 409; e2e/ repeats the main path on a real API server.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from fleetpilot.api import InferenceService, parse_service
from fleetpilot.api.status import (
    Condition,
    ConditionStatus,
    InferenceServiceStatus,
    RoleStatus,
    TierStatus,
)
from fleetpilot.autoscaler.actuator import (
    AutoscalerMetrics,
    KubernetesActuator,
    Replicas,
    merge_roles,
    no_metrics_source_condition,
    no_metrics_source_recorded,
    scaling_active_condition,
    with_condition,
)
from fleetpilot.autoscaler.model import DataProblem, Decision, History, ReasonKind
from fleetpilot.kube.client import MERGE_CONTENT_TYPE, KubeError, Obj
from tests.factories import make_manifest, make_tier
from tests.support.actuators import MemoryActuator
from tests.support.kube import FakeKube

NOW = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
DEPLOYMENT_PATH = "/apis/apps/v1/namespaces/ml/deployments/chat-large-decode"


def service_manifest(**autoscaling: Any) -> Obj:
    manifest = make_manifest(
        "chat",
        uid="uid-1",
        tiers=[
            make_tier("small", up_to=0.4),
            make_tier("large", mode="disaggregated", autoscaling=autoscaling or {}),
        ],
    )
    manifest["metadata"].update(generation=7, resourceVersion="100")
    # The status as the operator writes it: conditions and replicas the autoscaler must keep.
    status = InferenceServiceStatus(
        observed_generation=7,
        endpoint="http://chat-router.ml.svc:8000/v1",
        conditions=[
            Condition(
                type="Ready",
                status=ConditionStatus.TRUE,
                reason="AllReplicasReady",
                message="every role and the router are ready",
                last_transition_time=NOW - timedelta(hours=1),
                observed_generation=7,
            )
        ],
        tiers=[
            TierStatus(name="small", roles=[RoleStatus(role="unified", replicas=1, ready=1)]),
            TierStatus(
                name="large",
                roles=[
                    RoleStatus(role="prefill", replicas=1, ready=1),
                    RoleStatus(role="decode", replicas=3, ready=3),
                ],
            ),
        ],
    )
    manifest["status"] = status.to_wire()
    return manifest


@pytest.fixture
def api() -> FakeKube:
    api = FakeKube()
    api.put(service_manifest())
    api.put(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "chat-large-decode", "namespace": "ml"},
            "spec": {"replicas": 3},
            "status": {"replicas": 3, "readyReplicas": 2},
        }
    )
    return api


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def actuator(api: FakeKube, registry: CollectorRegistry) -> KubernetesActuator:
    return KubernetesActuator(api, metrics=AutoscalerMetrics(registry))


@pytest.fixture
def service(api: FakeKube) -> InferenceService:
    return parse_service(live_service(api))


def decision(
    replicas: int = 5,
    current: int = 3,
    *,
    role: str = "decode",
    tier: str = "large",
    dry_run: bool = False,
    problem: DataProblem | None = None,
    reason: str | None = None,
    kind: ReasonKind = ReasonKind.TPOT,
) -> Decision:
    return Decision(
        tier=tier,
        role=role,
        current_replicas=current,
        replicas=replicas,
        recommendation=replicas,
        reason=reason or f"{role} tpot p95 100ms > slo 60ms: {current} -> {replicas}",
        reason_kind=kind,
        history=History(),
        data_problem=problem,
        dry_run=dry_run,
    )


def live_service(api: FakeKube) -> Obj:
    live = api.object("InferenceService", "ml", "chat")
    assert live is not None
    return live


def status_patches(api: FakeKube) -> list[Obj]:
    return [c.body for c in api.writes_of("PATCH", "InferenceService", "status") if c.body]


def events(api: FakeKube) -> list[Obj]:
    return api.objects("Event", "ml")


def roles_of(obj: Obj) -> dict[tuple[str, str], Obj]:
    return {(t["name"], r["role"]): r for t in obj["status"]["tiers"] for r in t["roles"]}


def conditions_of(obj: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in obj["status"]["conditions"]}


def test_current_reads_spec_and_ready_replicas(
    actuator: KubernetesActuator, service: InferenceService
) -> None:
    """Ready replicas come from status: pods still starting are not counted as capacity."""
    assert actuator.current(service, "large", "decode") == Replicas(current=3, ready=2)
    assert actuator.current(service, "large", "prefill") is None  # no Deployment yet


def test_scale_patches_the_scale_subresource_as_the_autoscaler(
    api: FakeKube, actuator: KubernetesActuator, service: InferenceService
) -> None:
    """A merge patch of /scale under fieldManager fleetpilot-autoscaler, nothing else."""
    actuator.scale(service, "large", "decode", 5)
    call = api.calls[-1]
    assert (call.method, call.path) == ("PATCH", DEPLOYMENT_PATH + "/scale")
    assert call.query == [("fieldManager", "fleetpilot-autoscaler")]
    assert call.body == {"spec": {"replicas": 5}}
    assert call.content_type == "application/merge-patch+json"
    assert api.object("Deployment", "ml", "chat-large-decode")["spec"]["replicas"] == 5


def test_a_multi_node_role_is_read_and_scaled_through_its_leader_worker_set(
    registry: CollectorRegistry,
) -> None:
    """A role whose replicas span nodes runs as a LeaderWorkerSet: its replicas (groups) and
    ready ones are read from the set, and scaling patches the set's /scale - never a
    Deployment of the same name (one left from before the role spanned nodes)."""
    api = FakeKube()
    multi_node = {"parallelism": {"tensor": 4, "pipeline": 2}, "resources": {"gpusPerNode": 4}}
    api.put(make_manifest("chat", uid="uid-1", tiers=[make_tier("big", **multi_node)]))
    for kind, replicas, ready in [("LeaderWorkerSet", 2, 1), ("Deployment", 5, 5)]:
        api.put(
            {
                "kind": kind,
                "metadata": {"name": "chat-big", "namespace": "ml"},
                "spec": {"replicas": replicas},
                "status": {"replicas": replicas, "readyReplicas": ready},
            }
        )
    actuator = KubernetesActuator(api, metrics=AutoscalerMetrics(registry))
    service = parse_service(live_service(api))

    assert actuator.current(service, "big", "unified") == Replicas(current=2, ready=1)
    actuator.scale(service, "big", "unified", 4)
    call = api.calls[-1]
    path = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ml/leaderworkersets/chat-big/scale"
    assert (call.method, call.path) == ("PATCH", path)
    assert call.query == [("fieldManager", "fleetpilot-autoscaler")]
    assert call.body == {"spec": {"replicas": 4}}
    assert api.object("LeaderWorkerSet", "ml", "chat-big")["spec"]["replicas"] == 4
    assert api.object("Deployment", "ml", "chat-big")["spec"]["replicas"] == 5
    assert actuator.current(service, "big", "unified") == Replicas(current=4, ready=1)


def test_record_writes_desired_last_scale_condition_event_and_metrics(
    api: FakeKube,
    actuator: KubernetesActuator,
    service: InferenceService,
    registry: CollectorRegistry,
) -> None:
    """One tick's decisions reach status (desired, lastScale), ScalingActive, an Event and
    the metrics; what the operator wrote (replicas, Ready, the other tier) stays."""
    decisions = [decision(5, 3), decision(1, 1, role="prefill", kind=ReasonKind.WITHIN_TOLERANCE)]
    condition = scaling_active_condition(decisions, 7, NOW)
    actuator.record(service, decisions, condition, NOW)

    live = live_service(api)
    roles = roles_of(live)
    assert roles[("large", "decode")] == {
        "role": "decode",
        "replicas": 3,
        "ready": 3,
        "desired": 5,
        "lastScale": {
            "time": "2026-11-29T10:00:00Z",
            "fromReplicas": 3,
            "toReplicas": 5,
            "reason": "decode tpot p95 100ms > slo 60ms: 3 -> 5",
        },
    }
    assert roles[("large", "prefill")] == {
        "role": "prefill",
        "replicas": 1,
        "ready": 1,
        "desired": 1,
    }
    assert roles[("small", "unified")] == {"role": "unified", "replicas": 1, "ready": 1}
    conditions = conditions_of(live)
    assert conditions["Ready"] == service_manifest()["status"]["conditions"][0]
    assert conditions["ScalingActive"] == {
        "type": "ScalingActive",
        "status": "True",
        "reason": "FreshMetrics",
        "message": "deciding on fresh metrics: large/decode, large/prefill",
        "lastTransitionTime": "2026-11-29T10:00:00Z",
        "observedGeneration": 7,
    }
    assert live["status"]["endpoint"] == "http://chat-router.ml.svc:8000/v1"
    (patch,) = status_patches(api)
    assert patch["metadata"] == {"resourceVersion": "100"}

    (event,) = events(api)
    assert event["reason"] == "ScaledUp"
    assert event["type"] == "Normal"
    assert event["message"] == "tier large: decode tpot p95 100ms > slo 60ms: 3 -> 5"
    assert event["involvedObject"] == {
        "apiVersion": "fleetpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "chat",
        "namespace": "ml",
        "uid": "uid-1",
    }
    assert event["source"] == {"component": "fleetpilot-autoscaler"}

    labels = {"namespace": "ml", "service": "chat", "tier": "large", "role": "decode"}
    assert registry.get_sample_value("fleetpilot_autoscaler_desired_replicas", labels) == 5
    counted = {**labels, "direction": "up", "reason_kind": "tpot"}
    assert registry.get_sample_value("fleetpilot_autoscaler_decisions_total", counted) == 1
    held = {**labels, "role": "prefill", "direction": "none", "reason_kind": "within_tolerance"}
    assert registry.get_sample_value("fleetpilot_autoscaler_decisions_total", held) == 1


def test_an_unchanged_tick_writes_nothing(
    api: FakeKube, actuator: KubernetesActuator, service: InferenceService
) -> None:
    """Holding steady rewrites no status and posts no Event (only metrics move)."""
    hold = decision(3, 3, kind=ReasonKind.WITHIN_TOLERANCE, reason="decode within: holding 3")
    condition = scaling_active_condition([hold], 7, NOW)
    actuator.record(service, [hold], condition, NOW)
    writes = len(status_patches(api))
    actuator.record(
        service,
        [hold],
        scaling_active_condition([hold], 7, NOW + timedelta(minutes=1)),
        NOW + timedelta(minutes=1),
    )
    assert len(status_patches(api)) == writes == 1
    assert events(api) == []


def test_a_conflict_is_re_read_and_retried(
    api: FakeKube, actuator: KubernetesActuator, service: InferenceService
) -> None:
    """Another writer between read and patch: 409, re-read, patched on the new version."""
    versions: list[str] = []

    def another_writer() -> None:
        api.touch("InferenceService", "ml", "chat")
        versions.append(live_service(api)["metadata"]["resourceVersion"])

    api.interleave("PATCH", "InferenceService", another_writer, subresource="status")
    decisions = [decision(5, 3)]
    actuator.record(service, decisions, scaling_active_condition(decisions, 7, NOW), NOW)
    first, second = status_patches(api)
    assert first["metadata"]["resourceVersion"] == "100"
    assert second["metadata"]["resourceVersion"] == versions[0]
    assert roles_of(live_service(api))[("large", "decode")]["desired"] == 5
    assert len(events(api)) == 1


def test_persistent_conflicts_give_up_with_the_error(
    api: FakeKube, actuator: KubernetesActuator, service: InferenceService
) -> None:
    """Another writer wins every race: the actuator gives up after five tries and raises the
    conflict (the loop logs it and decides afresh next tick)."""
    api.interleave(
        "PATCH",
        "InferenceService",
        lambda: api.touch("InferenceService", "ml", "chat"),
        subresource="status",
        times=None,
    )
    decisions = [decision(5, 3)]
    with pytest.raises(KubeError) as raised:
        actuator.record(service, decisions, scaling_active_condition(decisions, 7, NOW), NOW)
    assert raised.value.conflict
    assert len(status_patches(api)) == 5


def test_condition_keeps_its_transition_time_until_it_flips(
    api: FakeKube, actuator: KubernetesActuator, service: InferenceService
) -> None:
    """lastTransitionTime says since when: unchanged while the status holds, moved when it
    flips; a flip to False posts a Warning Event with the reason."""
    fresh = [decision(3, 3, kind=ReasonKind.WITHIN_TOLERANCE)]
    actuator.record(service, fresh, scaling_active_condition(fresh, 7, NOW), NOW)
    later = NOW + timedelta(minutes=5)
    actuator.record(service, fresh, scaling_active_condition(fresh, 7, later), later)
    assert conditions_of(live_service(api))["ScalingActive"]["lastTransitionTime"] == (
        "2026-11-29T10:00:00Z"
    )
    down = [
        decision(
            3,
            3,
            problem=DataProblem.UNREACHABLE,
            kind=ReasonKind.NO_DATA,
            reason="decode has no data (cannot connect to prometheus): holding 3",
        )
    ]
    actuator.record(service, down, scaling_active_condition(down, 8, later), later)
    condition = conditions_of(live_service(api))["ScalingActive"]
    assert condition["status"] == "False"
    assert condition["reason"] == "PrometheusUnreachable"
    assert condition["lastTransitionTime"] == "2026-11-29T10:05:00Z"
    assert condition["observedGeneration"] == 7  # metadata.generation of the live object
    assert condition["message"] == (
        "tier large: decode has no data (cannot connect to prometheus): holding 3"
    )
    (warning,) = events(api)
    assert (warning["type"], warning["reason"]) == ("Warning", "PrometheusUnreachable")


def test_recommend_mode_records_once_and_never_scales(
    api: FakeKube, actuator: KubernetesActuator, service: InferenceService
) -> None:
    """mode recommend: desired and lastScale say what would happen, one Event per new
    recommendation, and the Deployment is never touched."""
    dry = [decision(5, 3, dry_run=True)]
    actuator.record(service, dry, scaling_active_condition(dry, 7, NOW), NOW)
    later = NOW + timedelta(seconds=15)
    actuator.record(service, dry, scaling_active_condition(dry, 7, later), later)
    role = roles_of(live_service(api))[("large", "decode")]
    assert role["desired"] == 5
    assert role["lastScale"]["time"] == "2026-11-29T10:00:00Z"
    assert role["lastScale"]["reason"].startswith(
        "recommended (autoscaling.mode recommend): decode tpot p95"
    )
    assert [e["reason"] for e in events(api)] == ["ScaleRecommended"]
    assert api.object("Deployment", "ml", "chat-large-decode")["spec"]["replicas"] == 3
    assert not [c for c in api.calls if c.subresource == "scale"]


def test_a_refused_event_does_not_fail_the_record(
    api: FakeKube, actuator: KubernetesActuator, service: InferenceService
) -> None:
    """Events are a courtesy: status and metrics already hold the decision."""
    api.refuse("POST", "Event", 403)
    decisions = [decision(5, 3)]
    actuator.record(service, decisions, scaling_active_condition(decisions, 7, NOW), NOW)
    assert roles_of(live_service(api))[("large", "decode")]["desired"] == 5


def test_a_deleted_service_records_nothing(
    api: FakeKube, actuator: KubernetesActuator, service: InferenceService
) -> None:
    """The service was deleted between the tick's read and its record: nothing is written
    and no Event is posted on an object that is gone."""
    api.delete("InferenceService", "ml", "chat")
    decisions = [decision(5, 3)]
    actuator.record(service, decisions, scaling_active_condition(decisions, 7, NOW), NOW)
    assert status_patches(api) == []
    assert events(api) == []


@pytest.mark.parametrize(
    ("problems", "status", "reason"),
    [
        ([None, None], "True", "FreshMetrics"),
        ([DataProblem.STALE, None], "False", "StaleMetrics"),
        ([DataProblem.MISSING, DataProblem.STALE], "False", "MetricsMissing"),
        ([DataProblem.QUERY_ERROR, None], "False", "MetricsMissing"),
        ([DataProblem.STALE, DataProblem.UNREACHABLE], "False", "PrometheusUnreachable"),
    ],
)
def test_scaling_active_names_the_gravest_problem(
    problems: list[DataProblem | None], status: str, reason: str
) -> None:
    """Unreachable before missing (or refused) before stale; True only when all is fresh."""
    decisions = [
        decision(3, 3, role=role, problem=p)
        for role, p in zip(["prefill", "decode"], problems, strict=True)
    ]
    condition = scaling_active_condition(decisions, 4, NOW)
    assert (condition.status.value, condition.reason) == (status, reason)
    assert condition.observed_generation == 4


def test_merge_roles_adds_missing_tiers_and_roles() -> None:
    """Before the operator's first status write, the autoscaler's records still land."""
    tiers, eventful = merge_roles([], [decision(2, 1)], NOW)
    ((tier, roles),) = [(t["name"], t["roles"]) for t in tiers]
    assert tier == "large"
    assert [(r["role"], r["desired"], r["lastScale"]["toReplicas"]) for r in roles] == [
        ("decode", 2, 2)
    ]
    assert eventful == [decision(2, 1)]


def test_the_in_memory_actuator_records_what_the_cluster_one_does(
    api: FakeKube, actuator: KubernetesActuator, service: InferenceService
) -> None:
    """The tests' in-memory actuator (tests/support) scales, records and emits Events as the
    Kubernetes actuator does, so loop tests on it say something about the real one."""
    memory = MemoryActuator({("large", "decode"): Replicas(3, 3)})
    memory.scale(service, "large", "decode", 5)
    assert memory.current(service, "large", "decode") == Replicas(5, 5)
    decisions = [decision(5, 3), decision(1, 1, role="prefill", kind=ReasonKind.WITHIN_TOLERANCE)]
    condition = scaling_active_condition(decisions, 7, NOW)
    memory.record(service, decisions, condition, NOW)
    actuator.record(service, decisions, condition, NOW)
    assert memory.events == [(e["reason"], e["message"]) for e in events(api)]

    def records(tiers: list[Obj]) -> dict[tuple[str, str], Obj]:
        return {
            (t["name"], r["role"]): {k: r[k] for k in ("desired", "lastScale") if k in r}
            for t in tiers
            for r in t["roles"]
            if "desired" in r
        }

    assert records(live_service(api)["status"]["tiers"]) == records(memory.status_tiers)
    assert memory.conditions == [condition]


# -- no metrics source (issue 47: loud where silent) ----------------------------------------


def test_no_metrics_source_names_the_autoscaled_tiers_and_the_fix() -> None:
    """No Prometheus for the operator or the service: ScalingActive False, NoMetricsSource,
    naming each tier the autoscaler decides for (with its roles) and the settings that give
    it one; a service with no such tier gets no condition at all."""
    manifest = service_manifest()
    manifest["spec"]["tiers"].append(make_tier("fixed", autoscaling={"mode": "external"}))
    manifest["spec"]["tiers"][1]["complexity"] = {"upTo": 0.8}
    condition = no_metrics_source_condition(parse_service(manifest), NOW)
    assert condition is not None
    assert (condition.status, condition.reason) == (ConditionStatus.FALSE, "NoMetricsSource")
    assert condition.observed_generation == 7
    assert "tiers small (unified), large (prefill, decode) from" in condition.message
    for words in ("chart value prometheusURL", "--prometheus-url", "spec.monitoring.prometheusUrl"):
        assert words in condition.message
    assert "fixed" not in condition.message
    for tier in manifest["spec"]["tiers"]:
        tier["autoscaling"] = {"mode": "disabled"}
    assert no_metrics_source_condition(parse_service(manifest), NOW) is None


def test_no_metrics_source_is_recorded_and_announced_once_per_generation(
    api: FakeKube, actuator: KubernetesActuator, service: InferenceService
) -> None:
    """The condition and one Warning Event; a tick on the same generation writes nothing -
    also one holding the body from before the write (its patch meets 409, the re-read finds
    the condition there); a new generation is written and announced again, the condition
    keeping its transition time (still False). The operator's conditions stay."""
    stale = live_service(api)
    assert not no_metrics_source_recorded(stale)
    condition = no_metrics_source_condition(service, NOW)
    assert condition is not None
    assert actuator.record_no_source(service, condition, NOW, stale)
    live = live_service(api)
    assert no_metrics_source_recorded(live)
    assert conditions_of(live)["Ready"]["status"] == "True"
    (event,) = events(api)
    assert (event["type"], event["reason"]) == ("Warning", "NoMetricsSource")
    assert event["message"] == condition.message
    later = NOW + timedelta(seconds=5)
    for body in (stale, live):
        assert not actuator.record_no_source(service, condition, later, body)
    assert len(events(api)) == 1

    api.request(
        "PATCH",
        "/apis/fleetpilot.dev/v1alpha1/namespaces/ml/inferenceservices/chat",
        body={"spec": {"routing": {"replicas": 3}}},
        content_type=MERGE_CONTENT_TYPE,
    )
    changed = parse_service(live_service(api))
    assert changed.metadata.generation == 8
    assert not no_metrics_source_recorded(live_service(api))
    again = no_metrics_source_condition(changed, later)
    assert again is not None
    assert actuator.record_no_source(changed, again, later, live_service(api))
    written = conditions_of(live_service(api))["ScalingActive"]
    assert written["observedGeneration"] == 8
    assert written["lastTransitionTime"] == NOW.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert [e["reason"] for e in events(api)] == ["NoMetricsSource"] * 2


def test_with_condition_stamps_the_live_generation_and_says_when_the_status_flips() -> None:
    def scaling(status: ConditionStatus, generation: int | None = None) -> Condition:
        return Condition(
            type="ScalingActive",
            status=status,
            reason="FreshMetrics" if status is ConditionStatus.TRUE else "NoMetricsSource",
            message="m",
            last_transition_time=NOW,
            observed_generation=generation,
        )

    ready = {"type": "Ready", "status": "True", "reason": "R", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
    live: Obj = {"metadata": {"generation": 9}, "status": {"conditions": [ready]}}
    conditions, flipped = with_condition(live, scaling(ConditionStatus.FALSE, generation=3))
    assert flipped  # a new condition
    assert [c["type"] for c in conditions] == ["Ready", "ScalingActive"]
    assert conditions[1]["observedGeneration"] == 9  # the object as read, not the caller's
    live["status"]["conditions"] = conditions
    assert not with_condition(live, scaling(ConditionStatus.FALSE))[1]
    assert with_condition(live, scaling(ConditionStatus.TRUE))[1]
    assert with_condition({}, scaling(ConditionStatus.TRUE)) == (
        [scaling(ConditionStatus.TRUE).to_wire()],
        True,
    )
