"""Operator metrics, served on /metrics by ``fleetpilot operator``."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "fleetpilot_operator_reconciles_total",
    "Reconciles of InferenceServices, by outcome (applied, unchanged, refused).",
    ["result"],
)
RECONCILE_ERRORS = Counter(
    "fleetpilot_operator_reconcile_errors_total", "Reconciles that failed with an API error."
)
RECONCILE_DURATION = Histogram(
    "fleetpilot_operator_reconcile_duration_seconds",
    "Wall time of one reconcile.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
ADAPTER_CALLS = Counter(
    "fleetpilot_operator_adapter_calls_total",
    "Calls to engines of lora.dynamic tiers, by call (list, load, reload, unload) and result.",
    ["call", "result"],
)

# The services' status as metrics, from the operator's watch of InferenceServices (every
# status write, the autoscaler's included, arrives as an event): what the chart's alerts and
# dashboard read, in the shape of kube-state-metrics' condition gauges.
CONDITION = Gauge(
    "fleetpilot_inferenceservice_condition",
    "1 for each condition's current status (True, False or Unknown), 0 for the others.",
    ["namespace", "service", "type", "status"],
)
ROLE_REPLICAS = Gauge(
    "fleetpilot_inferenceservice_role_replicas",
    "Replicas of a role from the service's status: spec (the Deployment's), ready, desired "
    "(the autoscaler's latest recommendation).",
    ["namespace", "service", "tier", "role", "state"],
)
_STATUSES = ("True", "False", "Unknown")
_exported: dict[tuple[str, str], list[tuple[Gauge, tuple[str, ...]]]] = {}


def export_status(body: Mapping[str, Any]) -> None:
    """Set the gauges of one service from its latest body (replacing what it had)."""
    metadata = body.get("metadata", {})
    key = (str(metadata.get("namespace", "")), str(metadata.get("name", "")))
    forget(*key)
    status = body.get("status") or {}
    series: list[tuple[Gauge, tuple[str, ...]]] = []
    for condition in status.get("conditions") or []:
        for value in _STATUSES:
            condition_labels = (*key, str(condition.get("type")), value)
            is_current = condition.get("status") == value
            CONDITION.labels(*condition_labels).set(1.0 if is_current else 0.0)
            series.append((CONDITION, condition_labels))
    for tier in status.get("tiers") or []:
        for role in tier.get("roles") or []:
            for state, field in (("spec", "replicas"), ("ready", "ready"), ("desired", "desired")):
                if role.get(field) is None:
                    continue
                role_labels = (*key, str(tier.get("name")), str(role.get("role")), state)
                ROLE_REPLICAS.labels(*role_labels).set(float(role[field]))
                series.append((ROLE_REPLICAS, role_labels))
    _exported[key] = series


def forget(namespace: str, name: str) -> None:
    """Drop a deleted (or re-exported) service's series."""
    for gauge, labels in _exported.pop((namespace, name), []):
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)
