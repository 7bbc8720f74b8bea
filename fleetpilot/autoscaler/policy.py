"""The scaling decision for one role of one tier. Purely computational, no side effects.

``decide(observation, spec, history, now) -> Decision`` reads plain data and returns plain data:
no clock, no I/O, no state kept between calls. What must be remembered from one decision to
the next (past recommendations, panic mode) is the :class:`History` passed in, returned updated
inside the :class:`Decision`; the caller keeps it.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from fleetpilot.api.spec import AutoscalingMode, RoleName, Tier
from fleetpilot.api.units import format_duration

# ceil()/floor() of ratios computed in floating point: 3 x (0.6 / 0.2) is 9.000000000000002,
# which must size to 9 replicas, not 10.
_EPSILON = 1e-9
# Ratios beyond this are the same emergency; capping keeps ceil() of them finite.
_MAX_RATIO = 1e6
# Three intervals without a decision (a restart, an outage) and the watching starts over.
_MAX_GAP_INTERVALS = 3


class DataProblem(StrEnum):
    """Why the data behind a decision cannot be trusted; each maps to a condition reason."""

    UNREACHABLE = "unreachable"  # Prometheus did not answer (connection, timeout, 5xx)
    QUERY_ERROR = "query_error"  # Prometheus refused the query (PromQL error)
    MISSING = "missing"  # it answered, but a series the role needs does not exist
    STALE = "stale"  # the newest sample is older than max_data_age_s


class ReasonKind(StrEnum):
    """What drove a decision, as a short label for metrics (the sentence is in ``reason``)."""

    TTFT = "ttft"
    TPOT = "tpot"
    KV_CACHE = "kv_cache"
    QUEUE = "queue"
    SCALE_FROM_ZERO = "scale_from_zero"
    IDLE = "idle"
    WITHIN_TOLERANCE = "within_tolerance"
    STABILIZING = "stabilizing"
    PANIC = "panic"
    BOUNDS = "bounds"
    NOT_READY = "not_ready"
    FEW_SAMPLES = "few_samples"
    NO_DATA = "no_data"
    STALE = "stale"


class Direction(StrEnum):
    UP = "up"
    DOWN = "down"
    NONE = "none"


@dataclass(frozen=True)
class Metrics:
    """What a metrics source read for one role over one window; None means "no value".

    ``problem`` and ``detail`` say why values are missing, in words a person can act on.
    """

    ttft_p95_s: float | None = None
    ttft_samples: float | None = None  # requests that got a first token within the window
    tpot_p95_s: float | None = None
    tpot_samples: float | None = None  # inter-token intervals observed within the window
    kv_cache_usage_frac: float | None = None  # mean over engines, 0..1 (vLLM's "_perc")
    waiting_requests: float | None = None  # summed over engines
    running_requests: float | None = None  # summed over engines
    reporting_engines: int | None = None  # engine series seen (data-parallel ranks count apart)
    prefix_hit_rate_frac: float | None = None  # recorded for people; decides nothing
    arrival_rate_rps: float | None = None  # completed requests per second, over the window
    data_age_s: float | None = None  # age of the newest engine sample; None: no sample at all
    problem: DataProblem | None = None
    detail: str = ""
    # Set when the values come from a stand-in for the usual source (the engines' /metrics
    # while Prometheus is down), saying so: every decision's reason repeats it.
    source_note: str = ""


@dataclass(frozen=True)
class Observation:
    """One role as it is now: its replicas (from the cluster) and its metrics (from a source)."""

    current_replicas: int
    ready_replicas: int
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def waiting_per_replica(self) -> float | None:
        waiting = self.metrics.waiting_requests
        if waiting is None or self.ready_replicas <= 0:
            return None
        return waiting / self.ready_replicas


@dataclass(frozen=True)
class Recommendation:
    """One past raw recommendation, before stabilization and limits."""

    time_s: float
    replicas: int


@dataclass(frozen=True)
class History:
    """Everything ``decide`` remembers between calls, as plain immutable data."""

    recommendations: tuple[Recommendation, ...] = ()
    panic_until_s: float | None = None
    # Since when recommendations have come without a gap: a scale-down needs a whole
    # scale-down window watched, so a restarted autoscaler does not shrink on its first lull.
    watching_since_s: float | None = None

    def in_panic(self, now_s: float) -> bool:
        return self.panic_until_s is not None and now_s < self.panic_until_s


@dataclass(frozen=True)
class RolePolicy:
    """The autoscaling settings of one role, flattened from the spec into seconds and ratios.

    The fields beyond the spec have defaults explained where they are set; ``for_role`` builds
    one from a tier.
    """

    role: str
    min_replicas: int
    max_replicas: int
    tier: str = ""
    mode: AutoscalingMode = AutoscalingMode.AUTO
    interval_s: float = 15.0
    ttft_p95_slo_s: float | None = None
    tpot_p95_slo_s: float | None = None
    kv_cache_usage_target_frac: float = 0.8
    queue_target: float = 2.0  # waiting requests per ready replica
    tolerance: float = 0.1
    scale_up_stabilization_s: float = 0.0
    scale_up_max_rate: float = 2.0
    scale_down_stabilization_s: float = 300.0
    scale_down_max_rate: float = 2.0
    # Twice the target, as Knative's panic threshold (200%): a burst that doubles load within
    # one interval is not noise, and waiting out a stabilization window would breach the SLO.
    panic_threshold: float = 2.0
    # One minute: the default PromQL window, so panic lasts until the burst has left the window.
    panic_window_s: float = 60.0
    # Ten requests: below that a p95 is the maximum of a handful of requests, one slow outlier.
    min_samples: int = 10
    # Three scrapes of 15 s: one or two failed scrapes are ordinary; three mean the engines (or
    # the scraping) are gone and the numbers describe the past.
    max_data_age_s: float = 45.0

    def __post_init__(self) -> None:
        if self.role not in set(RoleName):
            roles = ", ".join(RoleName)
            raise ValueError(f"role must be one of {roles}, not {self.role!r}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("replicas: need 0 <= min <= max")
        for name in ("ttft_p95_slo_s", "tpot_p95_slo_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive")
        if self.kv_cache_usage_target_frac <= 0 or self.queue_target <= 0:
            raise ValueError("kv_cache_usage_target_frac and queue_target must be positive")
        if not 0 <= self.tolerance < 1:
            raise ValueError("tolerance must lie in [0, 1)")
        if self.scale_up_max_rate < 1 or self.scale_down_max_rate < 1:
            raise ValueError("max rates must be at least 1")

    @property
    def follows_ttft(self) -> bool:
        """Prefill (and unified) replicas make first tokens: they follow TTFT and the queue."""
        return self.role in (RoleName.UNIFIED, RoleName.PREFILL)

    @property
    def follows_tpot(self) -> bool:
        """Decode (and unified) replicas make the other tokens: they follow TPOT and KV usage."""
        return self.role in (RoleName.UNIFIED, RoleName.DECODE)

    @classmethod
    def for_role(
        cls, tier: Tier, role: str, *, scrape_interval_s: float = 15.0, **overrides: Any
    ) -> RolePolicy:
        """The policy of one role of a tier; ``overrides`` replace any field (tests, CLI)."""
        scaling = tier.autoscaling
        resolved = tier.role(role)
        if resolved is None:
            roles = ", ".join(tier.role_names)
            raise ValueError(f"tier {tier.name!r} has no {role} role (it runs {roles})")
        bounds = resolved.replicas
        slo = scaling.slo
        values: dict[str, Any] = {
            "role": role,
            "tier": tier.name,
            "min_replicas": bounds.min,
            "max_replicas": bounds.max,
            "mode": scaling.mode,
            "interval_s": scaling.interval.total_seconds(),
            "ttft_p95_slo_s": slo.ttft_p95.total_seconds() if slo.ttft_p95 else None,
            "tpot_p95_slo_s": slo.tpot_p95.total_seconds() if slo.tpot_p95 else None,
            "kv_cache_usage_target_frac": scaling.kv_cache_usage_target,
            "queue_target": scaling.queue_target,
            "tolerance": scaling.tolerance,
            "scale_up_stabilization_s": scaling.scale_up.stabilization.total_seconds(),
            "scale_up_max_rate": scaling.scale_up.max_rate,
            "scale_down_stabilization_s": scaling.scale_down.stabilization.total_seconds(),
            "scale_down_max_rate": scaling.scale_down.max_rate,
            "panic_window_s": max(scaling.window.total_seconds(), scaling.interval.total_seconds()),
            "max_data_age_s": 3 * scrape_interval_s,
        }
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True)
class Decision:
    """What to run for one role, and why, in a sentence fit for an Event."""

    tier: str
    role: str
    current_replicas: int
    replicas: int
    recommendation: int  # the raw recommendation, before stabilization, rate and bounds
    reason: str
    reason_kind: ReasonKind
    history: History
    data_problem: DataProblem | None = None
    panic: bool = False
    dry_run: bool = False  # mode recommend: record, do not scale
    # What was decided on: recorders show it next to the decision (the local status table).
    observation: Observation | None = None

    @property
    def direction(self) -> Direction:
        if self.replicas > self.current_replicas:
            return Direction.UP
        if self.replicas < self.current_replicas:
            return Direction.DOWN
        return Direction.NONE

    @property
    def changed(self) -> bool:
        return self.replicas != self.current_replicas


# ------------------------------------------------------------------------------ signals


@dataclass(frozen=True)
class _Signal:
    kind: ReasonKind
    observed: float
    target: float

    @property
    def ratio(self) -> float:
        # A p95 beyond the histogram's last finite bucket reads +Inf: as overloaded as can be,
        # which the rate limit turns into one maximal step.
        if not math.isfinite(self.observed):
            return _MAX_RATIO
        return min(max(self.observed, 0.0) / self.target, _MAX_RATIO)

    def observed_text(self) -> str:
        return f"{_SIGNAL_NAMES[self.kind]} {_format(self.kind, self.observed)}"

    def target_text(self) -> str:
        label = "slo" if self.kind in (ReasonKind.TTFT, ReasonKind.TPOT) else "target"
        return f"{label} {_format(self.kind, self.target)}"


_SIGNAL_NAMES = {
    ReasonKind.TTFT: "ttft p95",
    ReasonKind.TPOT: "tpot p95",
    ReasonKind.KV_CACHE: "kv cache usage",
    ReasonKind.QUEUE: "waiting",
}


def _format(kind: ReasonKind, value: float) -> str:
    if kind in (ReasonKind.TTFT, ReasonKind.TPOT):
        return format_seconds(value)
    if kind is ReasonKind.KV_CACHE:
        return f"{value:.0%}"
    return f"{value:.1f}/replica"


def format_seconds(value_s: float) -> str:
    """``0.072`` -> ``72ms``, ``1.5`` -> ``1.5s``: latencies as people write them."""
    if not math.isfinite(value_s):
        return "beyond the largest bucket"
    if value_s < 1:
        return f"{value_s * 1000:.0f}ms"
    return f"{value_s:.3g}s"


def _window(seconds: float) -> str:
    # Whole seconds from one second up: "watched 28s", not "watched 28022ms".
    return format_duration(timedelta(seconds=round(seconds) if seconds >= 1 else round(seconds, 3)))


@dataclass(frozen=True)
class _Assessment:
    """The raw recommendation with what explains it."""

    replicas: int
    kind: ReasonKind
    text: str
    problem: DataProblem | None = None
    worst_ratio: float | None = None


def _latency_signal(
    kind: ReasonKind,
    value_s: float | None,
    samples: float | None,
    slo_s: float | None,
    policy: RolePolicy,
    usable: list[_Signal],
    blockers: list[str],
    missing: list[str],
) -> None:
    if slo_s is None:
        return  # no objective set: this role does not follow this latency
    name = _SIGNAL_NAMES[kind]
    if samples is None:
        missing.append(f"{name} (no request count)")
    elif samples <= 0:
        return  # no requests in the window: nothing to measure, and nothing waits on it
    elif samples < policy.min_samples:
        blockers.append(f"{name} from {samples:.0f} samples (fewer than {policy.min_samples})")
    elif value_s is None:
        missing.append(name)
    else:
        usable.append(_Signal(kind, value_s, slo_s))


def _assess(observation: Observation, policy: RolePolicy) -> _Assessment:
    current = observation.current_replicas
    ready = min(observation.ready_replicas, current)
    m = observation.metrics
    tolerance = policy.tolerance

    if current == 0:
        return _assess_from_zero(m, policy)
    if m.problem in (DataProblem.UNREACHABLE, DataProblem.QUERY_ERROR):
        return _Assessment(current, ReasonKind.NO_DATA, f"has no data ({m.detail})", m.problem)
    if ready == 0:
        # Starting engines (loading weights takes minutes) export nothing yet; that is expected.
        return _Assessment(current, ReasonKind.NOT_READY, f"has no ready replica yet (0/{current})")
    if m.problem is DataProblem.STALE:
        text = f"has stale metrics ({m.detail or 'said the source'}), not deciding on them"
        return _Assessment(current, ReasonKind.STALE, text, DataProblem.STALE)
    if m.problem is DataProblem.MISSING or m.data_age_s is None:
        detail = m.detail or "no engine metrics"
        return _Assessment(
            current, ReasonKind.NO_DATA, f"has no data ({detail})", DataProblem.MISSING
        )
    if m.data_age_s > policy.max_data_age_s:
        text = (
            f"metrics are {m.data_age_s:.0f}s old (stale after {policy.max_data_age_s:.0f}s), "
            "not deciding on them"
        )
        return _Assessment(current, ReasonKind.STALE, text, DataProblem.STALE)

    usable: list[_Signal] = []
    blockers: list[str] = []  # why a scale-down is not allowed now
    missing: list[str] = []
    if policy.follows_ttft:
        _latency_signal(
            ReasonKind.TTFT,
            m.ttft_p95_s,
            m.ttft_samples,
            policy.ttft_p95_slo_s,
            policy,
            usable,
            blockers,
            missing,
        )
        if m.waiting_requests is None:
            missing.append("waiting requests")
        else:
            usable.append(
                _Signal(ReasonKind.QUEUE, m.waiting_requests / ready, policy.queue_target)
            )
    if policy.follows_tpot:
        _latency_signal(
            ReasonKind.TPOT,
            m.tpot_p95_s,
            m.tpot_samples,
            policy.tpot_p95_slo_s,
            policy,
            usable,
            blockers,
            missing,
        )
        if m.kv_cache_usage_frac is None:
            missing.append("kv cache usage")
        else:
            usable.append(
                _Signal(
                    ReasonKind.KV_CACHE, m.kv_cache_usage_frac, policy.kv_cache_usage_target_frac
                )
            )
    problem = DataProblem.MISSING if missing else None
    if missing:
        blockers.insert(0, f"no {', '.join(missing)}")
    hold_kind = ReasonKind.NO_DATA if missing else ReasonKind.FEW_SAMPLES

    if not usable:
        return _Assessment(current, hold_kind, f"has {'; '.join(blockers)}", problem)
    worst = max(usable, key=lambda s: s.ratio)
    ratio = worst.ratio
    if ratio > 1 + tolerance:
        # Overloaded: size the ready capacity up; starting pods will absorb part of it, so never
        # go below what already runs.
        replicas = max(current, _ceil(ready * ratio))
        return _Assessment(
            replicas, worst.kind, f"{worst.observed_text()} > {worst.target_text()}", problem, ratio
        )
    if ratio >= 1 - tolerance:
        text = f"{worst.observed_text()} within {tolerance:.0%} of {worst.target_text()}"
        return _Assessment(current, ReasonKind.WITHIN_TOLERANCE, text, problem, ratio)

    below = f"{worst.observed_text()} < {worst.target_text()}"
    if len(usable) > 1:
        below = f"{below} (the highest of {', '.join(_SIGNAL_NAMES[s.kind] for s in usable)})"
    # Size so the worst ratio lands at the bottom of the tolerance band (rule 3).
    replicas = min(current, _ceil(ready * ratio / (1 - tolerance)))
    if replicas < current and blockers:
        text = f"{below}, but {'; '.join(blockers)}: not scaling down"
        return _Assessment(current, hold_kind, text, problem, ratio)
    if replicas < current and ready < current:
        text = f"{below}, but {current - ready} of {current} replicas are not ready yet"
        return _Assessment(current, ReasonKind.NOT_READY, text, problem, ratio)
    kind = worst.kind
    if all(s.observed == 0 for s in usable):
        kind = ReasonKind.IDLE
        below = f"is idle ({', '.join(s.observed_text() for s in usable)}, no requests)"
    return _Assessment(replicas, kind, below, problem, ratio)


def _assess_from_zero(m: Metrics, policy: RolePolicy) -> _Assessment:
    # No replicas means no engine series: missing engine metrics are expected here. Only a
    # failure to ask at all is a problem, since demand cannot be seen through it.
    if m.problem in (DataProblem.UNREACHABLE, DataProblem.QUERY_ERROR):
        return _Assessment(0, ReasonKind.NO_DATA, f"has no data ({m.detail})", m.problem)
    waiting = m.waiting_requests or 0.0
    arriving = m.arrival_rate_rps or 0.0
    running = m.running_requests or 0.0
    if waiting > 0:
        replicas = max(1, _ceil(waiting / policy.queue_target))
        text = f"has {waiting:.0f} requests waiting and no replicas"
        return _Assessment(replicas, ReasonKind.SCALE_FROM_ZERO, text)
    if arriving > 0 or running > 0:
        text = f"has requests arriving ({arriving:.2g}/s) and no replicas"
        return _Assessment(1, ReasonKind.SCALE_FROM_ZERO, text)
    return _Assessment(0, ReasonKind.IDLE, "has no replicas and no demand")


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

    # Panic starts on a burst and lasts panic_window_s after the last one.
    panic_until = history.panic_until_s
    if assessment.worst_ratio is not None and assessment.worst_ratio >= spec.panic_threshold:
        panic_until = max(panic_until or now_s, now_s + spec.panic_window_s)
    in_panic = panic_until is not None and now_s < panic_until

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
    new_history = History(recommendations, panic_until if in_panic else None, watching_since)

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

    kind, reason = _explain(
        spec,
        current,
        assessment,
        stabilized,
        limited,
        final,
        in_panic,
        panic_until,
        now_s,
        watched_s,
    )
    if observation.metrics.source_note:
        reason = f"{reason} [{observation.metrics.source_note}]"
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


def _explain(
    spec: RolePolicy,
    current: int,
    assessment: _Assessment,
    stabilized: int,
    limited: int,
    final: int,
    in_panic: bool,
    panic_until: float | None,
    now_s: float,
    watched_s: float,
) -> tuple[ReasonKind, str]:
    """The reason kind and sentence: ``"decode tpot p95 72ms > slo 60ms: 3 -> 5"``."""
    role, raw, why = spec.role, assessment.replicas, assessment.text
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
        return assessment.kind, f"{role} {why}: {change}{suffix}"
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
        return assessment.kind, f"{role} {why}: {change}{suffix}"

    hold = f"holding {current}"
    if raw > current:
        if stabilized <= current:
            window = _window(spec.scale_up_stabilization_s)
            return ReasonKind.STABILIZING, (
                f"{role} {why}, {hold}: scale-up stabilization (the lowest recommendation of "
                f"the last {window} is {stabilized})"
            )
        return ReasonKind.BOUNDS, f"{role} {why}, {hold}: at max {spec.max_replicas}"
    if raw < current:
        if in_panic and panic_until is not None:
            left = panic_until - now_s
            return ReasonKind.PANIC, (
                f"{role} {why}, {hold}: panic mode after a burst, no scale-down for "
                f"{_window(math.ceil(left))}"
            )
        if stabilized >= current:
            window = _window(spec.scale_down_stabilization_s)
            if watched_s < spec.scale_down_stabilization_s:
                return ReasonKind.STABILIZING, (
                    f"{role} {why}, {hold}: scale-down stabilization (watched "
                    f"{_window(watched_s)} of the {window} a scale-down needs)"
                )
            return ReasonKind.STABILIZING, (
                f"{role} {why}, {hold}: scale-down stabilization (the highest recommendation "
                f"of the last {window} is {stabilized})"
            )
        return ReasonKind.BOUNDS, f"{role} {why}, {hold}: at min {spec.min_replicas}"
    return assessment.kind, f"{role} {why}: {hold}"


__all__ = [
    "DataProblem",
    "Decision",
    "Direction",
    "History",
    "Metrics",
    "Observation",
    "ReasonKind",
    "Recommendation",
    "RolePolicy",
    "decide",
    "format_seconds",
]
