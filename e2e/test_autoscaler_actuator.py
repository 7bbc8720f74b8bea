"""The Kubernetes actuator against a real API server.

The engine Deployment is planned and applied as the operator does it (server-side apply as
``fleetpilot-operator``); the actuator then scales it through the scale subresource and
records the decision. The API server, not a fake, decides who owns ``spec.replicas`` afterwards,
validates the status against the CRD schema and accepts (or not) the Event.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from fleetpilot.api import parse_service
from fleetpilot.autoscaler.actuator import (
    AutoscalerMetrics,
    KubernetesActuator,
    Replicas,
    scaling_active_condition,
)
from fleetpilot.autoscaler.model import (
    DataProblem,
    Direction,
    History,
    Metrics,
    Observation,
    RolePolicy,
)
from fleetpilot.autoscaler.policy import decide
from fleetpilot.kube.client import Kube, Obj
from fleetpilot.kube.managers import AUTOSCALER_MANAGER, OPERATOR_MANAGER
from fleetpilot.operator.planner import plan
from tests.factories import make_manifest, make_tier

pytestmark = pytest.mark.cluster


def _owners_of_replicas(deployment: Obj) -> set[str]:
    """Managers whose managedFields entry holds spec.replicas."""
    owners = set()
    for entry in deployment["metadata"].get("managedFields", []):
        fields: dict[str, Any] = entry.get("fieldsV1", {})
        if "f:replicas" in fields.get("f:spec", {}):
            owners.add(entry["manager"])
    return owners


def test_scale_and_record_on_a_real_api_server(
    kube: Kube, namespace: str, chart_crds: None
) -> None:
    """Scaled through /scale, spec.replicas belongs to fleetpilot-autoscaler alone; the
    status holds desired, lastScale and ScalingActive next to the operator's fields; an
    Event on the InferenceService carries the reason."""
    tier = make_tier(
        "small",
        serving={"replicas": {"min": 1, "max": 4}},
        autoscaling={"slo": {"ttftP95": "500ms"}},
    )
    manifest = make_manifest("chat", namespace=namespace, tiers=[tier])
    live = kube.apply(manifest, "e2e-test")
    service = parse_service(live)
    (deployment,) = [
        o
        for o in plan(service)
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "chat-small"
    ]
    kube.apply(deployment, OPERATOR_MANAGER)
    # The operator's status write (merge patch), which the autoscaler must not disturb.
    kube.patch_status(
        "InferenceService",
        namespace,
        "chat",
        {
            "observedGeneration": live["metadata"]["generation"],
            "tiers": [{"name": "small", "roles": [{"role": "unified", "replicas": 1, "ready": 1}]}],
        },
        OPERATOR_MANAGER,
    )

    actuator = KubernetesActuator(kube, metrics=AutoscalerMetrics(CollectorRegistry()))
    assert actuator.current(service, "small", "unified") == Replicas(current=1, ready=0)

    now = datetime.now(UTC).replace(microsecond=0)
    metrics = Metrics(
        ttft_p95_s=0.9,
        ttft_samples=300.0,
        waiting_requests=1.0,
        kv_cache_usage_frac=0.5,
        tpot_samples=0.0,
        data_age_s=2.0,
    )
    policy = RolePolicy.for_role(service.spec.tiers[0], "unified")
    decision = decide(Observation(1, 1, metrics), policy, History(), now)
    assert decision.direction is Direction.UP
    assert decision.reason == "unified ttft p95 900ms > slo 500ms: 1 -> 2"

    actuator.scale(service, "small", "unified", decision.replicas)
    scaled = kube.get("Deployment", namespace, "chat-small")
    assert scaled is not None
    assert scaled["spec"]["replicas"] == 2
    assert _owners_of_replicas(scaled) == {AUTOSCALER_MANAGER}

    condition = scaling_active_condition([decision], service.metadata.generation, now)
    actuator.record(service, [decision], condition, now)
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    recorded = kube.get("InferenceService", namespace, "chat")
    assert recorded is not None
    status = recorded["status"]
    (role,) = status["tiers"][0]["roles"]
    assert role == {
        "role": "unified",
        "replicas": 1,
        "ready": 1,
        "desired": 2,
        "lastScale": {
            "time": stamp,
            "fromReplicas": 1,
            "toReplicas": 2,
            "reason": "unified ttft p95 900ms > slo 500ms: 1 -> 2",
        },
    }
    assert status["observedGeneration"] == live["metadata"]["generation"]
    (scaling,) = status["conditions"]
    assert scaling["type"] == "ScalingActive"
    assert scaling["status"] == "True"
    assert scaling["observedGeneration"] == live["metadata"]["generation"]

    events = [
        e
        for e in kube.list("Event", namespace, {})
        if e["involvedObject"].get("name") == "chat" and e["reason"] == "ScaledUp"
    ]
    assert [e["message"] for e in events] == [
        "tier small: unified ttft p95 900ms > slo 500ms: 1 -> 2"
    ]
    assert events[0]["involvedObject"]["uid"] == live["metadata"]["uid"]

    # The next tick loses Prometheus: the condition flips, with a Warning Event; the rest stays.
    lost = decide(
        Observation(2, 2, Metrics(problem=DataProblem.UNREACHABLE, detail="connection refused")),
        policy,
        decision.history,
        now,
    )
    actuator.record(
        service, [lost], scaling_active_condition([lost], service.metadata.generation, now), now
    )
    after = kube.get("InferenceService", namespace, "chat")
    assert after is not None
    (scaling,) = after["status"]["conditions"]
    assert (scaling["status"], scaling["reason"]) == ("False", "PrometheusUnreachable")
    assert after["status"]["tiers"][0]["roles"][0]["lastScale"]["toReplicas"] == 2
    warnings = [
        e["reason"]
        for e in kube.list("Event", namespace, {})
        if e["involvedObject"].get("name") == "chat" and e["type"] == "Warning"
    ]
    assert warnings == ["PrometheusUnreachable"]
