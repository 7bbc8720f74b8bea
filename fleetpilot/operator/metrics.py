"""Operator metrics, served on /metrics by ``fleetpilot operator``."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

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
