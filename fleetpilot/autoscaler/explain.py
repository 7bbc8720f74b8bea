"""The sentence of a scaling decision: the reason shown in Events, status and the local CLI.
No I/O.

``reason(spec, assessment, sizing, source_note) -> (ReasonKind, str)`` words what
:func:`fleetpilot.autoscaler.policy.decide` found and did, e.g.
``"decode tpot p95 72ms > slo 60ms: 3 -> 5"``, and names what drove it as a short label for
metrics (a held decision is driven by stabilization, panic or a bound, not by its signal).
People, tests and the docs read these sentences: change their wording on purpose only.
"""

from __future__ import annotations

import math
from datetime import timedelta

from fleetpilot.api.units import format_duration
from fleetpilot.autoscaler.forecast import Projection, ReplicaCapacity
from fleetpilot.autoscaler.model import (
    ArrivingAtZero,
    Assessment,
    Finding,
    Gap,
    GapKind,
    Idle,
    NoDemand,
    NoReadyReplica,
    NoSeries,
    OldData,
    Over,
    ReasonKind,
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

_SIGNAL_NAMES = {
    ReasonKind.TTFT: "ttft p95",
    ReasonKind.TPOT: "tpot p95",
    ReasonKind.KV_CACHE: "kv cache usage",
    ReasonKind.QUEUE: "waiting",
}
# A missing value is named for what the source failed to give.
_MISSING_NAMES = {**_SIGNAL_NAMES, ReasonKind.QUEUE: "waiting requests"}


def format_seconds(value_s: float) -> str:
    """``0.072`` -> ``72ms``, ``1.5`` -> ``1.5s``: latencies as people write them."""
    if not math.isfinite(value_s):
        return "beyond the largest bucket"
    if value_s < 1:
        return f"{value_s * 1000:.0f}ms"
    return f"{value_s:.3g}s"


def _value(kind: ReasonKind, value: float) -> str:
    if kind in (ReasonKind.TTFT, ReasonKind.TPOT):
        return format_seconds(value)
    if kind is ReasonKind.KV_CACHE:
        return f"{value:.0%}"
    return f"{value:.1f}/replica"


def _observed(signal: Signal) -> str:
    return f"{_SIGNAL_NAMES[signal.kind]} {_value(signal.kind, signal.observed)}"


def _target(signal: Signal) -> str:
    label = "slo" if signal.kind in (ReasonKind.TTFT, ReasonKind.TPOT) else "target"
    return f"{label} {_value(signal.kind, signal.target)}"


def _window(seconds: float) -> str:
    # Whole seconds from one second up: "watched 28s", not "watched 28022ms".
    return format_duration(timedelta(seconds=round(seconds) if seconds >= 1 else round(seconds, 3)))


def _gaps(gaps: tuple[Gap, ...]) -> str:
    """``no waiting requests; ttft p95 from 3 samples (fewer than 10)``: absent values first."""
    missing = [
        f"{_MISSING_NAMES[g.kind]} (no request count)"
        if g.why is GapKind.NO_COUNT
        else _MISSING_NAMES[g.kind]
        for g in gaps
        if g.missing
    ]
    few = [
        f"{_SIGNAL_NAMES[g.kind]} from {g.samples:.0f} samples (fewer than {g.min_samples})"
        for g in gaps
        if not g.missing
    ]
    return "; ".join([f"no {', '.join(missing)}", *few] if missing else few)


def why(finding: Finding) -> str:
    """What the assessment found, after the role's name: ``tpot p95 72ms > slo 60ms``."""
    match finding:
        case Unanswered(detail):
            return f"has no data ({detail})"
        case NoSeries(detail):
            return f"has no data ({detail or 'no engine metrics'})"
        case NoReadyReplica(current):
            return f"has no ready replica yet (0/{current})"
        case StaleSource(detail):
            return f"has stale metrics ({detail or 'said the source'}), not deciding on them"
        case OldData(age_s, max_age_s):
            return (
                f"metrics are {age_s:.0f}s old (stale after {max_age_s:.0f}s), not deciding on them"
            )
        case WaitingAtZero(waiting):
            return f"has {waiting:.0f} requests waiting and no replicas"
        case ArrivingAtZero(rate):
            return f"has requests arriving ({rate:.2g}/s) and no replicas"
        case NoDemand():
            return "has no replicas and no demand"
        case Unusable(gaps):
            return f"has {_gaps(gaps)}"
        case Over(worst):
            return f"{_observed(worst)} > {_target(worst)}"
        case Within(worst, tolerance):
            return f"{_observed(worst)} within {tolerance:.0%} of {_target(worst)}"
        case Under(worst, signals, held_by, not_ready, current):
            below = f"{_observed(worst)} < {_target(worst)}"
            if len(signals) > 1:
                names = ", ".join(_SIGNAL_NAMES[s.kind] for s in signals)
                below = f"{below} (the highest of {names})"
            if held_by:
                return f"{below}, but {_gaps(held_by)}: not scaling down"
            if not_ready:
                return f"{below}, but {not_ready} of {current} replicas are not ready yet"
            return below
        case Idle(signals):
            return f"is idle ({', '.join(_observed(s) for s in signals)}, no requests)"


def reason(
    spec: RolePolicy, assessment: Assessment, sizing: Sizing, source_note: str = ""
) -> tuple[ReasonKind, str]:
    """The reason kind and sentence: ``"decode tpot p95 72ms > slo 60ms: 3 -> 5"``.

    A ``source_note`` (the values came from a stand-in source) is appended in brackets.
    """
    kind, text = _outcome(spec, assessment, sizing)
    if source_note:
        text = f"{text} [{source_note}]"
    return kind, text


def _outcome(spec: RolePolicy, assessment: Assessment, sizing: Sizing) -> tuple[ReasonKind, str]:
    role, raw, found = spec.role, assessment.replicas, why(assessment.finding)
    current, stabilized, limited, final = (
        sizing.current,
        sizing.stabilized,
        sizing.limited,
        sizing.final,
    )
    change = f"{current} -> {final}"
    notes: list[str] = []
    if final > current:
        if limited <= current:
            return ReasonKind.BOUNDS, f"{role} is below min {spec.min_replicas}: {change}"
        if stabilized < raw:
            notes.append(
                f"the lowest recommendation of the last {_window(spec.scale_up_stabilization_s)}"
                f" is {stabilized}"
            )
        if limited < stabilized:
            notes.append(f"at most x{spec.scale_up_max_rate:g} per step, wanted {stabilized}")
        if final < limited:
            notes.append(f"max {spec.max_replicas}")
        suffix = f" ({'; '.join(notes)})" if notes else ""
        return assessment.kind, f"{role} {found}: {change}{suffix}"
    if final < current:
        if limited >= current:
            return ReasonKind.BOUNDS, f"{role} is above max {spec.max_replicas}: {change}"
        if stabilized > raw:
            notes.append(
                f"the highest recommendation of the last "
                f"{_window(spec.scale_down_stabilization_s)} is {stabilized}"
            )
        if limited > stabilized:
            notes.append(f"at most /{spec.scale_down_max_rate:g} per step, wanted {stabilized}")
        if final > limited:
            notes.append(f"min {spec.min_replicas}")
        suffix = f" ({'; '.join(notes)})" if notes else ""
        return assessment.kind, f"{role} {found}: {change}{suffix}"

    hold = f"holding {current}"
    if raw > current:
        if stabilized <= current:
            window = _window(spec.scale_up_stabilization_s)
            return ReasonKind.STABILIZING, (
                f"{role} {found}, {hold}: scale-up stabilization (the lowest recommendation of "
                f"the last {window} is {stabilized})"
            )
        return ReasonKind.BOUNDS, f"{role} {found}, {hold}: at max {spec.max_replicas}"
    if raw < current:
        if sizing.panic_left_s is not None:
            return ReasonKind.PANIC, (
                f"{role} {found}, {hold}: panic mode after a burst, no scale-down for "
                f"{_window(math.ceil(sizing.panic_left_s))}"
            )
        if stabilized >= current:
            window = _window(spec.scale_down_stabilization_s)
            if sizing.watched_s < spec.scale_down_stabilization_s:
                return ReasonKind.STABILIZING, (
                    f"{role} {found}, {hold}: scale-down stabilization (watched "
                    f"{_window(sizing.watched_s)} of the {window} a scale-down needs)"
                )
            return ReasonKind.STABILIZING, (
                f"{role} {found}, {hold}: scale-down stabilization (the highest recommendation "
                f"of the last {window} is {stabilized})"
            )
        return ReasonKind.BOUNDS, f"{role} {found}, {hold}: at min {spec.min_replicas}"
    return assessment.kind, f"{role} {found}: {hold}"


__all__ = ["format_seconds", "reason", "why"]


def ahead(
    raw: int,
    ahead_of: int,
    projection: Projection,
    capacity: ReplicaCapacity | None,
    now_s: float,
) -> str:
    """The predictive part of a reason: what the trend projects, what it is sized by and what
    that asks for."""
    if capacity is not None and capacity.fresh(now_s):
        sized = (
            f"{capacity.rps_per_replica:.3g} req/s per replica at the objective "
            f"({_seen(capacity, now_s)})"
        )
    else:
        sized = "the load grown with the rate (no replica seen at the objective yet)"
    return (
        f"; predictive: arrivals {projection.rate_rps:.3g} -> {projection.projected_rps:.3g} "
        f"req/s in {format_seconds(projection.horizon_s)} (cold start + half the rate window), "
        f"sized by {sized}: {raw} -> {ahead_of}"
    )


def capacity_floor(floor: int, rate_rps: float, capacity: ReplicaCapacity, now_s: float) -> str:
    """Why a scale-down stops short: what the current rate needs at the capacity seen."""
    return (
        f"; not below {floor}: {rate_rps:.3g} req/s needs {floor} at "
        f"{capacity.rps_per_replica:.3g} req/s per replica (its objective, "
        f"{_seen(capacity, now_s)})"
    )


def _seen(capacity: ReplicaCapacity, now_s: float) -> str:
    """When the capacity was seen: ``now`` or ``12s ago``."""
    age_s = now_s - capacity.time_s
    return "now" if age_s < 1 else f"{format_seconds(age_s)} ago"


def cold_start_note(cold_start_s: float, rate_window_s: float) -> str:
    """When the replicas a scale-up adds will serve, from the role's observed cold start."""
    note = f"; new replicas serve in ~{format_seconds(cold_start_s)} (observed cold start)"
    if cold_start_s > rate_window_s:
        note += (
            f", longer than the {format_seconds(rate_window_s)} SLO window: too late for "
            "this burst (scaleUp.predictive starts them ahead of a ramp)"
        )
    return note


def zero_refused(cold_start_s: float, max_cold_start_s: float) -> str:
    return (
        f"; scale to zero refused: observed cold start {format_seconds(cold_start_s)} > "
        f"maxColdStart {format_seconds(max_cold_start_s)}"
    )
