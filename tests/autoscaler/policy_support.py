"""Inputs for decide(), the pure scaling policy: a role's policy, a healthy role's metrics, a
history that has watched a whole scale-down window. Shared by the policy's test modules."""

from __future__ import annotations

from typing import Any

from fleetpilot.autoscaler.model import History, Metrics, Recommendation, RolePolicy

T0 = 1_800_000_000.0  # a fixed POSIX time: decide() never reads a clock


def policy(role: str = "unified", **overrides: Any) -> RolePolicy:
    values: dict[str, Any] = {
        "role": role,
        "tier": "small",
        "min_replicas": 1,
        "max_replicas": 10,
        "ttft_p95_slo_s": 0.5,
        "tpot_p95_slo_s": 0.06,
    }
    values.update(overrides)
    return RolePolicy(**values)


def fresh(**values: Any) -> Metrics:
    """Metrics of a healthy role exactly at target (ratios 1.0 ... or below, where idle)."""
    base: dict[str, Any] = {
        "ttft_p95_s": 0.5,
        "ttft_samples": 200.0,
        "tpot_p95_s": 0.06,
        "tpot_samples": 5000.0,
        "kv_cache_usage_frac": 0.8,
        "waiting_requests": 0.0,
        "running_requests": 10.0,
        "reporting_engines": 3,
        "arrival_rate_rps": 5.0,
        "data_age_s": 2.0,
    }
    base.update(values)
    return Metrics(**base)


def watched(spec: RolePolicy, replicas: int, now: float = T0) -> History:
    """A history that has watched a whole scale-down window recommending ``replicas``."""
    start = now - spec.scale_down_stabilization_s - spec.interval_s
    times = [start + i * spec.interval_s for i in range(int((now - start) / spec.interval_s))]
    recs = tuple(Recommendation(t, replicas) for t in times if t < now)
    return History(recs, None, start)
