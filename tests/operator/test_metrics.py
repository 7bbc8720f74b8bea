"""The services' status as Prometheus series: one per condition and status, replaced on each
event, dropped with the service."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY

from fleetpilot.operator import metrics


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def _body(ready: str, desired: int | None = 3) -> dict[str, Any]:
    role: dict[str, Any] = {"role": "decode", "replicas": 2, "ready": 1}
    if desired is not None:
        role["desired"] = desired
    return {
        "metadata": {"namespace": "ml", "name": "chat"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": ready, "reason": "R"},
                {"type": "ScalingActive", "status": "False", "reason": "MetricsMissing"},
            ],
            "tiers": [{"name": "large", "roles": [role]}],
        },
    }


def test_conditions_and_replicas_follow_the_latest_status_and_go_with_the_service() -> None:
    condition = "fleetpilot_inferenceservice_condition"
    replicas = "fleetpilot_inferenceservice_role_replicas"
    metrics.export_status(_body("False"))
    ready = {"namespace": "ml", "service": "chat", "type": "Ready"}
    assert _value(condition, **ready, status="False") == 1.0
    assert _value(condition, **ready, status="True") == 0.0
    scaling = {"namespace": "ml", "service": "chat", "type": "ScalingActive", "status": "False"}
    assert _value(condition, **scaling) == 1.0
    role = {"namespace": "ml", "service": "chat", "tier": "large", "role": "decode"}
    assert _value(replicas, **role, state="spec") == 2.0
    assert _value(replicas, **role, state="ready") == 1.0
    assert _value(replicas, **role, state="desired") == 3.0

    metrics.export_status(_body("True", desired=None))
    assert _value(condition, **ready, status="True") == 1.0
    assert _value(condition, **ready, status="False") == 0.0
    assert _value(replicas, **role, state="desired") is None  # no longer recommended

    metrics.forget("ml", "chat")
    assert _value(condition, **ready, status="True") is None
    assert _value(replicas, **role, state="spec") is None
