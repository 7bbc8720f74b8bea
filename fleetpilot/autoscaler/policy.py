"""The scaling decision for one role of one tier. Purely computational, no side effects.

``decide(observation, spec, history, now) -> Decision`` reads plain data and returns plain data:
no clock, no I/O, no state kept between calls. What must be remembered from one decision to
the next (past recommendations, panic mode) is the :class:`History` passed in, returned updated
inside the :class:`Decision`; the caller keeps it. The data types are in
:mod:`~fleetpilot.autoscaler.model`; the reason's wording is in
:mod:`~fleetpilot.autoscaler.explain`.
Here, each signal is read into a :class:`~fleetpilot.autoscaler.model.Signal` (usable) or a
:class:`~fleetpilot.autoscaler.model.Gap` (why not), the role into an
:class:`~fleetpilot.autoscaler.model.Assessment` (the raw recommendation and what was found),
and that through the rules below into replicas.

The rules, in order:

1. **Signals.** Prefill and unified replicas follow TTFT p95 and the waiting queue; decode and
   unified replicas follow TPOT p95 and KV-cache usage. Each signal is a ratio
   ``observed / target``; the worst (highest) one decides.
2. **Capacity is what is ready.** ``recommendation = ceil(ready x worst ratio)``: pods still
   starting are not counted as capacity (they serve nothing yet), and while some are starting
   the role is never scaled down (they are about to become the capacity that was asked for).
3. **Tolerance.** While every ratio lies within ``1 +- tolerance`` nothing changes. A
   scale-down sizes the role so the worst ratio lands at ``1 - tolerance`` rather than at 1:
   sized to exactly 1, the next ordinary fluctuation would cross ``1 + tolerance`` and scale
   straight back up (flapping).
4. **Trust.** Never scale down on missing, stale or too-few-samples data: the role holds, and
   the reason says why. A latency percentile from fewer than ``min_samples`` requests is not
   used at all (the p95 of five requests is their maximum). No requests at all, with fresh
   gauges, is not "missing": it is an idle role, and it may shrink.
5. **Stabilization** (as the Kubernetes HPA): a scale-up goes to the *lowest* recommendation
   of the short scale-up window, a scale-down to the *highest* of the long scale-down window,
   so a role grows on a sustained rise and shrinks only after a sustained lull. A role is
   not scaled down before one whole scale-down window has been watched without a gap.
6. **Panic.** A ratio at or above ``panic_threshold`` (a sudden burst) starts panic mode for
   ``panic_window_s``: scale-ups skip the scale-up window and no scale-down happens at all.
7. **Rate.** One step multiplies replicas by at most ``scale_up.max_rate`` (at least +1) and
   divides them by at most ``scale_down.max_rate`` (at least -1).
8. **Bounds.** The result always lies within ``replicas.min .. replicas.max``.
9. **From zero.** A role at zero replicas has no engines to report latency; a waiting or
   arriving request (which a source may see upstream of the engines) scales it to one.
10. **Ahead of a ramp** (``scaleUp.predictive``). With a cold start observed, the
    recommendation is sized for the arrival rate the recent trend reaches by the time a
    replica started now would serve, over what one replica was seen to carry at the
    objective (:mod:`~fleetpilot.autoscaler.forecast`; until it was, the replicas' load grown
    with the rate); only upward.
11. **Cold starts.** A scale to zero is refused while the observed cold start exceeds
    ``maxColdStart``; a scale-up's reason says when its replicas will serve, and that they
    come too late for the current burst when the cold start is longer than the rate window.
12. **Capacity floor.** A scale-down never goes below the replicas the current arrival rate
    needs at what one replica was seen to carry at its objective (within the last 15
    minutes): latency falls far faster than load, so sizing by a low ratio alone would cut
    a busy role to a fraction (6 replicas at 20 req/s with TTFT at 0.23 of its objective
    were cut to 2, and scaled straight back up, in ``bench/autoscale_ramp.py``).
"""

from __future__ import annotations

import math
from datetime import datetime

from fleetpilot.api.spec import AutoscalingMode
from fleetpilot.autoscaler import explain, forecast
from fleetpilot.autoscaler.model import (
    ArrivingAtZero,
    Assessment,
    DataProblem,
    Decision,
    Gap,
    GapKind,
    History,
    Idle,
    Metrics,
    NoDemand,
    NoReadyReplica,
    NoSeries,
    Observation,
    OldData,
    Over,
    ReasonKind,
    Recommendation,
    RolePolicy,
    Signal,
    Sizing,
    StaleSource,
    Unanswered,
    Under,
    Unusable,
    WaitingAtZero,
    Within,
)

# ceil()/floor() of ratios computed in floating point: 3 x (0.6 / 0.2) is 9.000000000000002,
# which must size to 9 replicas, not 10.
_EPSILON = 1e-9
# Three intervals without a decision (a restart, an outage) and the watching starts over.
_MAX_GAP_INTERVALS = 3


# ------------------------------------------------------------------------------ signals


def _latency(
    kind: ReasonKind,
    value_s: float | None,
    samples: float | None,
    slo_s: float | None,
    min_samples: int,
) -> Signal | Gap | None:
    """A latency percentile against its SLO; None when it has nothing to say."""
    if slo_s is None:
        return None  # no objective set: this role does not follow this latency
    if samples is None:
        return Gap(kind, GapKind.NO_COUNT)
    if samples <= 0:
        return None  # no requests in the window: nothing to measure, and nothing waits on it
    if samples < min_samples:
        return Gap(kind, GapKind.FEW_SAMPLES, samples, min_samples)
    if value_s is None:
        return Gap(kind, GapKind.NO_VALUE)
    return Signal(kind, value_s, slo_s)


def _gauge(kind: ReasonKind, value: float | None, target: float) -> Signal | Gap:
    return Gap(kind, GapKind.NO_VALUE) if value is None else Signal(kind, value, target)


def _readings(m: Metrics, policy: RolePolicy, ready: int) -> tuple[Signal | Gap, ...]:
    """Every signal the role follows, in a fixed order (ttft, queue, tpot, kv cache usage)."""
    readings: list[Signal | Gap | None] = []
    if policy.follows_ttft:
        waiting = None if m.waiting_requests is None else m.waiting_requests / ready
        readings += [
            _latency(
                ReasonKind.TTFT,
                m.ttft_p95_s,
                m.ttft_samples,
                policy.ttft_p95_slo_s,
                policy.min_samples,
            ),
            _gauge(ReasonKind.QUEUE, waiting, policy.queue_target),
        ]
    if policy.follows_tpot:
        readings += [
            _latency(
                ReasonKind.TPOT,
                m.tpot_p95_s,
                m.tpot_samples,
                policy.tpot_p95_slo_s,
                policy.min_samples,
            ),
            _gauge(ReasonKind.KV_CACHE, m.kv_cache_usage_frac, policy.kv_cache_usage_target_frac),
        ]
    return tuple(r for r in readings if r is not None)


def _assess(observation: Observation, policy: RolePolicy) -> Assessment:
    current = observation.current_replicas
    ready = min(observation.ready_replicas, current)
    m = observation.metrics

    if current == 0:
        return _assess_from_zero(m, policy)
    if m.problem in (DataProblem.UNREACHABLE, DataProblem.QUERY_ERROR):
        return Assessment(current, ReasonKind.NO_DATA, Unanswered(m.detail), m.problem)
    if ready == 0:
        # Starting engines (loading weights takes minutes) export nothing yet; that is expected.
        return Assessment(current, ReasonKind.NOT_READY, NoReadyReplica(current))
    if m.problem is DataProblem.STALE:
        return Assessment(current, ReasonKind.STALE, StaleSource(m.detail), DataProblem.STALE)
    if m.problem is DataProblem.MISSING or m.data_age_s is None:
        return Assessment(current, ReasonKind.NO_DATA, NoSeries(m.detail), DataProblem.MISSING)
    if m.data_age_s > policy.max_data_age_s:
        old = OldData(m.data_age_s, policy.max_data_age_s)
        return Assessment(current, ReasonKind.STALE, old, DataProblem.STALE)
    return _assess_signals(current, ready, _readings(m, policy, ready), policy.tolerance)


def _assess_signals(
    current: int, ready: int, readings: tuple[Signal | Gap, ...], tolerance: float
) -> Assessment:
    usable = tuple(r for r in readings if isinstance(r, Signal))
    gaps = tuple(r for r in readings if isinstance(r, Gap))  # each blocks a scale-down
    missing = any(g.missing for g in gaps)
    problem = DataProblem.MISSING if missing else None
    hold_kind = ReasonKind.NO_DATA if missing else ReasonKind.FEW_SAMPLES

    if not usable:
        return Assessment(current, hold_kind, Unusable(gaps), problem)
    worst = max(usable, key=lambda s: s.ratio)
    ratio = worst.ratio
    if ratio > 1 + tolerance:
        # Overloaded: size the ready capacity up; starting pods will absorb part of it, so never
        # go below what already runs.
        replicas = max(current, _ceil(ready * ratio))
        return Assessment(replicas, worst.kind, Over(worst), problem, ratio)
    if ratio >= 1 - tolerance:
        within = Within(worst, tolerance)
        return Assessment(current, ReasonKind.WITHIN_TOLERANCE, within, problem, ratio)

    # Size so the worst ratio lands at the bottom of the tolerance band (rule 3).
    replicas = min(current, _ceil(ready * ratio / (1 - tolerance)))
    if replicas < current and gaps:
        held = Under(worst, usable, held_by=gaps)
        return Assessment(current, hold_kind, held, problem, ratio)
    if replicas < current and ready < current:
        starting = Under(worst, usable, not_ready=current - ready, current=current)
        return Assessment(current, ReasonKind.NOT_READY, starting, problem, ratio)
    if all(s.observed == 0 for s in usable):
        return Assessment(replicas, ReasonKind.IDLE, Idle(usable), problem, ratio)
    return Assessment(replicas, worst.kind, Under(worst, usable), problem, ratio)


def _assess_from_zero(m: Metrics, policy: RolePolicy) -> Assessment:
    # No replicas means no engine series: missing engine metrics are expected here. Only a
    # failure to ask at all is a problem, since demand cannot be seen through it.
    if m.problem in (DataProblem.UNREACHABLE, DataProblem.QUERY_ERROR):
        return Assessment(0, ReasonKind.NO_DATA, Unanswered(m.detail), m.problem)
    waiting = m.waiting_requests or 0.0
    arriving = m.arrival_rate_rps or 0.0
    running = m.running_requests or 0.0
    if waiting > 0:
        replicas = max(1, _ceil(waiting / policy.queue_target))
        return Assessment(replicas, ReasonKind.SCALE_FROM_ZERO, WaitingAtZero(waiting))
    if arriving > 0 or running > 0:
        return Assessment(1, ReasonKind.SCALE_FROM_ZERO, ArrivingAtZero(arriving))
    return Assessment(0, ReasonKind.IDLE, NoDemand())


def _ceil(value: float) -> int:
    return max(0, math.ceil(value - _EPSILON))


def _floor(value: float) -> int:
    return max(0, math.floor(value + _EPSILON))


def _seconds(now: float | datetime) -> float:
    return now.timestamp() if isinstance(now, datetime) else float(now)


# ------------------------------------------------------------------------------ decide


def decide(
    observation: Observation, spec: RolePolicy, history: History, now: float | datetime
) -> Decision:
    """The replicas one role should run now, with the reason. Purely computational.

    ``now`` is a POSIX time in seconds (or an aware datetime); ``history`` is what the previous
    call returned in ``Decision.history``. See the module docstring for the rules.
    """
    now_s = _seconds(now)
    current = observation.current_replicas
    if current < 0 or observation.ready_replicas < 0:
        raise ValueError("replica counts cannot be negative")
    assessment = _assess(observation, spec)
    raw = assessment.replicas
    rate = observation.metrics.arrival_rate_rps
    arrivals = forecast.keep_arrivals(history.arrivals, rate, now_s)
    capacity = forecast.observe_capacity(
        history.capacity,
        rate,
        observation.ready_replicas,
        assessment.worst_ratio,
        spec.tolerance,
        now_s,
    )
    floor_note = ""
    floor = forecast.needed_now(rate, capacity, now_s)
    if floor is not None and capacity is not None and raw < min(current, floor):
        # Rule 12: latency falls far faster than load, so a low ratio sizes a scale-down
        # below what the rate needs; the capacity seen says how far down is safe.
        floor_note = explain.capacity_floor(min(current, floor), rate or 0.0, capacity, now_s)
        raw = min(current, floor)
    ahead_note = ""
    if spec.predictive and assessment.worst_ratio is not None and current > 0:
        # Rule 10: size for the load expected once a replica started now would serve.
        projection = forecast.project(
            arrivals, observation.cold_start_s, spec.rate_window_s, spec.interval_s
        )
        if projection is not None:
            m, ready = observation.metrics, observation.ready_replicas
            load = forecast.load_fraction(
                assessment.worst_ratio,
                m.running_requests,
                m.waiting_requests,
                ready,
                spec.max_num_seqs,
            )
            ahead = forecast.ahead_of(projection, capacity, ready, load, now_s)
            if ahead > raw:
                ahead_note = explain.ahead(raw, ahead, projection, capacity, now_s)
                raw = ahead

    # Panic starts on a burst and lasts panic_window_s after the last one.
    panic_until = history.panic_until_s
    if assessment.worst_ratio is not None and assessment.worst_ratio >= spec.panic_threshold:
        panic_until = max(panic_until or now_s, now_s + spec.panic_window_s)
    panic_left_s = panic_until - now_s if panic_until is not None and now_s < panic_until else None
    in_panic = panic_left_s is not None

    keep_s = max(spec.scale_up_stabilization_s, spec.scale_down_stabilization_s)
    kept = tuple(r for r in history.recommendations if r.time_s >= now_s - keep_s)
    recommendations = (*kept, Recommendation(now_s, raw))
    last = history.recommendations[-1].time_s if history.recommendations else None
    watching_since = history.watching_since_s
    if (
        watching_since is None
        or last is None
        or now_s - last > _MAX_GAP_INTERVALS * spec.interval_s
    ):
        watching_since = now_s
    watched_s = now_s - watching_since
    new_history = History(
        recommendations, panic_until if in_panic else None, watching_since, arrivals, capacity
    )

    # Stabilization as the HPA does it: the lowest recommendation of the scale-up window may
    # raise replicas, the highest of the scale-down window may lower them.
    urgent = in_panic or (current == 0 and raw > 0)
    up_from = now_s - spec.scale_up_stabilization_s
    down_from = now_s - spec.scale_down_stabilization_s
    up_rec = raw if urgent else min(r.replicas for r in recommendations if r.time_s >= up_from)
    down_rec = max(r.replicas for r in recommendations if r.time_s >= down_from)
    stabilized = current
    if stabilized < up_rec:
        stabilized = up_rec
    if stabilized > down_rec:
        stabilized = down_rec
    if in_panic or watched_s < spec.scale_down_stabilization_s:
        stabilized = max(stabilized, current)

    up_limit = max(_ceil(current * spec.scale_up_max_rate), current + 1)
    down_limit = max(0, min(_floor(current / spec.scale_down_max_rate), current - 1))
    limited = min(max(stabilized, down_limit), up_limit)
    final = min(max(limited, spec.min_replicas), spec.max_replicas)
    cold_s = observation.cold_start_s
    bound_s = spec.max_cold_start_s
    zero_refused = ""
    if final == 0 < current and cold_s is not None and bound_s is not None and cold_s > bound_s:
        # Rule 11: a start this slow would hold the next request too long.
        final, zero_refused = 1, explain.zero_refused(cold_s, bound_s)

    sizing = Sizing(current, stabilized, limited, final, watched_s, panic_left_s)
    kind, reason = explain.reason(spec, assessment, sizing, observation.metrics.source_note)
    reason += floor_note + ahead_note + zero_refused
    if final > current and cold_s is not None:
        reason += explain.cold_start_note(cold_s, spec.rate_window_s)
    return Decision(
        tier=spec.tier,
        role=spec.role,
        current_replicas=current,
        replicas=final,
        recommendation=raw,
        reason=reason,
        reason_kind=kind,
        history=new_history,
        data_problem=assessment.problem,
        panic=in_panic,
        dry_run=spec.mode is AutoscalingMode.RECOMMEND,
        observation=observation,
    )


__all__ = ["decide"]
