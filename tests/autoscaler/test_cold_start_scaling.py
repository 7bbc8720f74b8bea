"""Scaling that knows how long a start takes: the predictive scale-up on a ramp, the refusal to
scale to zero past maxColdStart, and reasons that say when new replicas will serve."""

from __future__ import annotations

from typing import Any

import pytest

from fleetpilot.api import parse_service
from fleetpilot.autoscaler.forecast import (
    CAPACITY_MAX_AGE_S,
    MIN_POINTS,
    TREND_POINTS,
    ReplicaCapacity,
    ahead_of,
    keep_arrivals,
    load_fraction,
    needed_now,
    observe_capacity,
    project,
    slope,
)
from fleetpilot.autoscaler.loop import observed_cold_start
from fleetpilot.autoscaler.model import History, Observation, RolePolicy
from fleetpilot.autoscaler.policy import decide
from tests.autoscaler.policy_support import T0, fresh, policy, watched
from tests.factories import make_manifest

INTERVAL = 15.0


def ramp(start_rps: float, step_rps: float, points: int) -> tuple[tuple[float, float], ...]:
    return tuple((T0 + i * INTERVAL, start_rps + i * step_rps) for i in range(points))


# -- the forecast ---------------------------------------------------------------------------


def test_slope_is_the_least_squares_line() -> None:
    assert slope(ramp(2.0, 1.5, 5)) == pytest.approx(0.1)  # 1.5 req/s more every 15 s
    assert slope(((T0, 1.0),)) is None
    assert slope(((T0, 1.0), (T0, 3.0))) is None  # no time between them: no line


def test_a_ramp_is_projected_over_the_cold_start_plus_half_the_rate_window() -> None:
    """The rate is a mean over the window, half a window behind; a replica started now serves
    after the cold start: the projection reaches that far."""
    projection = project(ramp(2.0, 1.5, 4), cold_start_s=30.0, rate_window_s=60.0, interval_s=15)
    assert projection is not None
    assert projection.horizon_s == 60.0
    assert projection.rate_rps == 6.5
    assert projection.projected_rps == pytest.approx(6.5 + 0.1 * 60)


def test_the_projected_rate_is_sized_by_what_a_replica_carried_at_the_objective() -> None:
    """12.5 req/s projected: 5 replicas where one carried 2.6 req/s at the objective; without
    a fresh capacity, the ready replicas' load grown with the rate (x 12.5 / 6.5)."""
    projection = project(ramp(2.0, 1.5, 4), cold_start_s=30.0, rate_window_s=60.0, interval_s=15)
    assert projection is not None
    now = T0 + 100
    carried = ReplicaCapacity(now - 30, 2.6)
    assert ahead_of(projection, carried, ready=2, load=0.4, now_s=now) == 5
    assert ahead_of(projection, None, ready=4, load=1.0, now_s=now) == 8  # 7.7
    # A light load's ratio: the growth does not make 1 replica many (a step from idle).
    assert ahead_of(projection, None, ready=1, load=0.2, now_s=now) == 1
    stale = ReplicaCapacity(now - CAPACITY_MAX_AGE_S - 1, 2.6)
    assert ahead_of(projection, stale, ready=4, load=1.0, now_s=now) == 8


def test_the_load_is_the_worst_ratio_or_the_share_of_the_batches_in_use() -> None:
    """Latency stays flat until a queue forms; the batches fill with the load: the higher of
    the two, and the ratio alone without a batch size or a running count."""
    assert load_fraction(0.2, running=12.0, waiting=4.0, ready=2, batch=16) == 0.5
    assert load_fraction(0.7, running=4.0, waiting=0.0, ready=2, batch=16) == 0.7
    assert load_fraction(0.2, running=12.0, waiting=None, ready=2, batch=16) == 0.375
    assert load_fraction(0.2, running=None, waiting=4.0, ready=2, batch=16) == 0.2
    assert load_fraction(0.2, running=12.0, waiting=4.0, ready=2, batch=None) == 0.2


def test_capacity_is_seen_only_at_the_objective_and_the_highest_fresh_one_is_kept() -> None:
    """A role at (or past) its objective, 1 - tolerance and up, carries its capacity: rate per
    ready replica; below it, or without a rate or ready replicas, nothing is learned; a lower
    reading (a window still averaging in time before replicas joined) does not replace a
    higher fresh one, but does replace an old one."""
    seen = observe_capacity(None, 9.0, 3, 0.95, 0.1, T0)
    assert seen == ReplicaCapacity(T0, 3.0)
    assert observe_capacity(None, 9.0, 3, 0.85, 0.1, T0) is None  # below the objective
    assert observe_capacity(seen, None, 3, 2.0, 0.1, T0 + 10) == seen
    assert observe_capacity(seen, 9.0, 0, 2.0, 0.1, T0 + 10) == seen
    assert observe_capacity(seen, 0.0, 3, 2.0, 0.1, T0 + 10) == seen
    assert observe_capacity(seen, 6.0, 3, 3.0, 0.1, T0 + 10) == seen  # 2.0 < 3.0: kept
    assert observe_capacity(seen, 12.0, 3, 1.0, 0.1, T0 + 10) == ReplicaCapacity(T0 + 10, 4.0)
    later = T0 + CAPACITY_MAX_AGE_S + 1
    assert observe_capacity(seen, 6.0, 3, 1.0, 0.1, later) == ReplicaCapacity(later, 2.0)
    # A rate so small its share per replica underflows to 0 is no reading; a 0 capacity (from
    # a history written before this was checked) sizes nothing instead of dividing by it.
    assert observe_capacity(None, 5e-324, 3, 1.0, 0.1, T0) is None
    assert needed_now(9.0, ReplicaCapacity(T0, 0.0), T0) is None


@pytest.mark.parametrize(
    ("arrivals", "cold_start_s"),
    [
        (ramp(2.0, 1.5, 4), None),  # no cold start observed yet: no horizon
        (ramp(2.0, 1.5, MIN_POINTS - 1), 30.0),  # too few points for a trend
        (ramp(5.0, 0.0, 6), 30.0),  # steady: no extra replicas at steady state
        (ramp(9.0, -1.0, 6), 30.0),  # falling: never predictive down
        (ramp(10.0, 0.05, 6), 30.0),  # +3% over the horizon: noise, not a ramp
        (((T0, 2.0), (T0 + 5, 3.0), (T0 + 10, 4.0)), 30.0),  # within one interval
    ],
    ids=["no-cold-start", "few-points", "steady", "falling", "noise", "one-interval"],
)
def test_no_projection_without_a_real_rise(
    arrivals: tuple[tuple[float, float], ...], cold_start_s: float | None
) -> None:
    assert project(arrivals, cold_start_s, 60.0, INTERVAL) is None


def test_only_the_last_rates_are_kept_and_a_missing_one_is_skipped() -> None:
    kept = keep_arrivals(ramp(1.0, 1.0, TREND_POINTS), 99.0, T0 + 1000)
    assert len(kept) == TREND_POINTS
    assert kept[-1] == (T0 + 1000, 99.0)
    assert keep_arrivals(kept, None, T0 + 1015) == kept


# -- the policy -----------------------------------------------------------------------------


def run_ramp(spec: RolePolicy, cold_start_s: float | None, rates: list[float]) -> list[int]:
    """Replicas after each decision while the arrival rate follows ``rates`` and the latency
    holds at its target (load just met: the reactive rules see nothing to do)."""
    history, replicas, seen = History(), 2, []
    for step, rate in enumerate(rates):
        observation = Observation(replicas, replicas, fresh(arrival_rate_rps=rate), cold_start_s)
        decision = decide(observation, spec, history, T0 + step * spec.interval_s)
        history, replicas = decision.history, decision.replicas
        seen.append(replicas)
    return seen


def test_predictive_scales_ahead_of_a_ramp_and_adds_nothing_when_it_is_flat() -> None:
    """On a ramp the predictive role grows before any latency rises (the reactive one waits);
    on a flat load both hold their replicas."""
    rising = [2.0 + 1.5 * i for i in range(6)]
    reactive = run_ramp(policy(max_replicas=40), 30.0, rising)
    predictive = run_ramp(policy(max_replicas=40, predictive=True), 30.0, rising)
    assert reactive == [2] * 6
    assert predictive[-1] > 2
    assert predictive == sorted(predictive)  # only upward
    flat = run_ramp(policy(max_replicas=40, predictive=True), 30.0, [5.0] * 10)
    assert flat == [2] * 10
    unknown = run_ramp(policy(max_replicas=40, predictive=True), None, rising)
    assert unknown == [2] * 6  # no cold start observed: nothing to be ahead of


def test_a_predictive_reason_shows_the_projection_and_what_sized_it() -> None:
    spec = policy(max_replicas=40, predictive=True)
    now = T0 + 3 * INTERVAL
    history = History(arrivals=ramp(2.0, 1.5, 3))
    observation = Observation(2, 2, fresh(arrival_rate_rps=6.5), 30.0)
    decision = decide(observation, spec, history, now)
    assert decision.replicas > 2
    assert "predictive: arrivals 6.5 -> " in decision.reason
    assert "in 60s (cold start + half the rate window)" in decision.reason
    # At its objective now (fresh() is exactly at target): this decision saw the capacity.
    assert "sized by 3.25 req/s per replica at the objective (now)" in decision.reason
    assert "new replicas serve in ~30s (observed cold start)" in decision.reason
    assert decision.history.capacity == ReplicaCapacity(now, 3.25)

    light = fresh(arrival_rate_rps=6.5, ttft_p95_s=0.2, tpot_p95_s=0.02, kv_cache_usage_frac=0.3)
    unsized = decide(Observation(2, 2, light, 30.0), spec, history, now)
    assert "sized by the load grown with the rate (no replica seen at the objective yet)" in (
        unsized.reason
    )
    assert unsized.history.capacity is None


def test_a_predictive_role_started_from_idle_does_not_multiply_its_one_replica() -> None:
    """The windowed rate of a load that starts from idle rises for one window: a steep
    "ramp" from a tiny rate. With the role far below its objective and no capacity seen, the
    projection does not turn 1 replica into many (it did, before capacity sizing)."""
    spec = policy(max_replicas=40, predictive=True, min_replicas=1)
    history = History()
    replicas = 1
    for step, rate in enumerate([0.3, 0.7, 1.1, 1.5, 1.9]):
        light = fresh(
            arrival_rate_rps=rate, ttft_p95_s=0.05, tpot_p95_s=0.01, kv_cache_usage_frac=0.05
        )
        decision = decide(
            Observation(replicas, replicas, light, 12.0), spec, history, T0 + step * INTERVAL
        )
        history, replicas = decision.history, decision.replicas
    assert replicas == 1


def test_a_scale_up_slower_than_the_slo_window_says_so() -> None:
    """Overloaded, with a cold start longer than the rate window: the scale-up happens and its
    reason says it comes too late for this burst."""
    observation = Observation(2, 2, fresh(ttft_p95_s=0.9), 300.0)
    decision = decide(observation, policy(), History(), T0)
    assert decision.replicas > 2
    assert "new replicas serve in ~300s (observed cold start)" in decision.reason
    assert "longer than the 60s SLO window: too late for this burst" in decision.reason


@pytest.mark.parametrize(
    ("cold_start_s", "bound_s", "expected"),
    [(120.0, 60.0, 1), (30.0, 60.0, 0), (None, 60.0, 0), (120.0, None, 0)],
    ids=["slower-than-bound", "within-bound", "never-observed", "no-bound"],
)
def test_scale_to_zero_is_refused_while_the_cold_start_exceeds_max_cold_start(
    cold_start_s: float | None, bound_s: float | None, expected: int
) -> None:
    spec = policy(min_replicas=0, max_cold_start_s=bound_s)
    idle = fresh(
        ttft_samples=0.0, tpot_samples=0.0, kv_cache_usage_frac=0.0, running_requests=0.0,
        arrival_rate_rps=0.0,
    )  # fmt: skip
    decision = decide(Observation(1, 1, idle, cold_start_s), spec, watched(spec, 0), T0)
    assert decision.replicas == expected, decision.reason
    refused = "scale to zero refused: observed cold start 120s > maxColdStart 60s"
    assert (refused in decision.reason) == (expected == 1)


# -- the loop reads the cold start from status ----------------------------------------------


def service_with_cold_start(**cold_start: Any) -> Any:
    manifest = make_manifest(namespace="ml")
    role: dict[str, Any] = {"role": "unified", "replicas": 1, "ready": 1}
    if cold_start:
        sample = {
            "pod": "chat-small-1", "startedAt": "2026-12-04T10:00:00Z",
            "readyAt": "2026-12-04T10:01:10Z", "startSeconds": 70,
        }  # fmt: skip
        role["coldStart"] = {**cold_start, "samples": [sample]}
    manifest["status"] = {"tiers": [{"name": "small", "roles": [role]}]}
    return parse_service(manifest)


def test_the_loop_reads_the_slowest_pod_start_from_status() -> None:
    summary = {"count": 2, "p50Seconds": 40, "maxSeconds": 95}
    service = service_with_cold_start(count=2, start={**summary, "maxSeconds": 70}, pod=summary)
    assert observed_cold_start(service, "small", "unified") == 95.0
    restarts_only = service_with_cold_start(count=1, start={**summary, "maxSeconds": 70})
    assert observed_cold_start(restarts_only, "small", "unified") == 70.0
    assert observed_cold_start(service_with_cold_start(), "small", "unified") is None
    assert observed_cold_start(service, "large", "unified") is None


# -- the capacity floor ---------------------------------------------------------------------


def test_a_scale_down_stops_at_what_the_rate_needs_at_the_capacity_seen() -> None:
    """6 replicas at 20 req/s with TTFT at a fifth of its objective: the ratio alone sizes 2
    (latency falls far faster than load); one replica having carried 6 req/s at the
    objective, the role keeps 4. Without a capacity seen, or once it is old, the ratio
    decides; a floor above the current replicas adds none (that is the signals' job)."""
    spec = policy(scale_down_stabilization_s=0.0, scale_down_max_rate=10.0)
    quiet = fresh(arrival_rate_rps=20.0, ttft_p95_s=0.1, tpot_p95_s=0.01, kv_cache_usage_frac=0.1)
    seen = ReplicaCapacity(T0 - 60, 6.0)
    history = History(capacity=seen)
    kept = decide(Observation(6, 6, quiet), spec, history, T0)
    assert kept.replicas == 4
    assert "not below 4: 20 req/s needs 4 at 6 req/s per replica (its objective, 60s ago)" in (
        kept.reason
    )
    assert decide(Observation(6, 6, quiet), spec, History(), T0).replicas < 4
    old = History(capacity=ReplicaCapacity(T0 - CAPACITY_MAX_AGE_S - 1, 6.0))
    assert decide(Observation(6, 6, quiet), spec, old, T0).replicas < 4
    assert decide(Observation(3, 3, quiet), spec, history, T0).replicas <= 3
