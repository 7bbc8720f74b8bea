"""The services' status as Prometheus series: one per condition and status, replaced on each
event, dropped with the service; and each tier's SLO objectives, per role they are about."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY

from fleetpilot.operator import metrics
from tests.factories import make_manifest, make_tier


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


def _slo(kind: str, tier: str, role: str, service: str = "chat") -> float | None:
    labels = {"namespace": "ml", "service": service, "tier": tier, "role": role}
    return _value(f"fleetpilot_slo_{kind}_seconds", **labels)


def _with_slos(generation: int, large_ttft: str = "1500ms") -> dict[str, Any]:
    """Three tiers: `small` (unified) with both objectives, `large` (disaggregated) with a TTFT
    objective only, `batch` with none."""
    tiers = [
        make_tier("small", model="Qwen/Qwen2.5-0.5B-Instruct", up_to=0.3,
                  autoscaling={"slo": {"ttftP95": "800ms", "tpotP95": "50ms"}}),
        make_tier("large", model="Qwen/Qwen2.5-72B-Instruct", tensor=4, up_to=0.8,
                  mode="disaggregated", autoscaling={"slo": {"ttftP95": large_ttft}}),
        make_tier("batch"),
    ]  # fmt: skip
    body = make_manifest(tiers=tiers)
    body["metadata"]["generation"] = generation
    return body


def test_each_tiers_objectives_are_exported_for_the_roles_they_are_about() -> None:
    """TTFT for the roles that make first tokens (unified, prefill), TPOT for those that make
    the rest (unified, decode), each with its own tier's value; a tier or a role without an
    objective has no series (so no alert compares anything with it)."""
    metrics.export_status(_with_slos(1))
    assert _slo("ttft", "small", "unified") == 0.8
    assert _slo("tpot", "small", "unified") == 0.05
    assert _slo("ttft", "large", "prefill") == 1.5
    assert _slo("ttft", "large", "decode") is None
    assert _slo("tpot", "large", "decode") is None
    assert _slo("tpot", "large", "prefill") is None
    for kind in ("ttft", "tpot"):
        assert _slo(kind, "batch", "unified") is None

    # A new generation's objective replaces the old; a status write (same generation) keeps it.
    metrics.export_status(_with_slos(2, large_ttft="3s"))
    assert _slo("ttft", "large", "prefill") == 3.0
    metrics.export_status({**_with_slos(2, large_ttft="3s"), "status": {"conditions": []}})
    assert _slo("ttft", "large", "prefill") == 3.0
    # A status the API models would not take (a condition without its reason and time) hides
    # no objective: they are the spec's.
    unchecked = {"conditions": [{"type": "Ready", "status": "True"}]}
    metrics.export_status({**_with_slos(3, large_ttft="4s"), "status": unchecked})
    assert _slo("ttft", "large", "prefill") == 4.0

    metrics.forget("ml", "chat")
    assert _slo("ttft", "small", "unified") is None
    assert _slo("ttft", "large", "prefill") is None


def test_a_spec_the_reconciler_refuses_exports_no_objectives() -> None:
    """Read as the reconciler reads the spec: one that does not validate has no objectives
    (and the previous generation's are dropped with it)."""
    metrics.export_status(_with_slos(1))
    assert _slo("ttft", "small", "unified") == 0.8
    invalid = _with_slos(2)
    invalid["spec"]["tiers"][0]["autoscaling"]["slo"]["ttftP95"] = "800"  # no unit
    metrics.export_status(invalid)
    assert _slo("ttft", "small", "unified") is None
    assert _slo("ttft", "large", "prefill") is None
    metrics.forget("ml", "chat")
