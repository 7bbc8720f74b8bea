"""The autoscaler's plain data: what is observed, the settings, the history and the decision.
No I/O.

Frozen dataclasses and enums with no behaviour beyond validating themselves: the metrics
sources fill :class:`Metrics`, :func:`fleetpilot.autoscaler.policy.decide` turns an
:class:`Observation`, a :class:`RolePolicy` and a :class:`History` into a :class:`Decision`,
and the actuators record it. The types of the decision's middle steps (:class:`Signal`,
:class:`Gap`, the findings, :class:`Assessment`, :class:`Sizing`) live here too, so that
:mod:`fleetpilot.autoscaler.explain` can word them without importing the policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fleetpilot.api.capacity import role_capacity
from fleetpilot.api.spec import AutoscalingMode, ResolvedRole, RoleName, Tier
from fleetpilot.autoscaler.forecast import ReplicaCapacity

# Ratios beyond this are the same emergency; capping keeps ceil() of them finite.
_MAX_RATIO = 1e6


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
    # Device and host-tier hits over prompt tokens; recorded for people, decides nothing.
    prefix_hit_rate_frac: float | None = None
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
    # The role's observed cold start (status coldStart: the slowest kept pod start, created to
    # Ready); None until one was seen.
    cold_start_s: float | None = None

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
    # Recent arrival rates (time, requests/s), for the predictive scale-up's trend.
    arrivals: tuple[tuple[float, float], ...] = ()
    # What one replica carried at the objective, for the predictive scale-up's sizing.
    capacity: ReplicaCapacity | None = None

    def in_panic(self, now_s: float) -> bool:
        return self.panic_until_s is not None and now_s < self.panic_until_s


# The KV-usage target never drops below this for headroom: a cache so small that one
# full-length sequence takes half of it is a capacity problem (CapacitySufficient says so),
# which scaling out at low usage would only hide.
MIN_KV_USAGE_TARGET = 0.5


def kv_usage_target(role: ResolvedRole) -> float:
    """The role's KV-cache usage target: the spec's, lowered where the cache is small enough
    that at that usage one more sequence of maxModelLen would not fit (vLLM would preempt to
    admit it): 1 - maxModelLen / KV tokens of a replica (``api.capacity``), not under
    ``MIN_KV_USAGE_TARGET``. Roles the planner cannot size keep the spec's."""
    target = role.tier.autoscaling.kv_cache_usage_target
    sized = role_capacity(role)
    max_len = role.tier.model.max_model_len
    if sized is None or not sized.fits or max_len is None:
        return target
    headroom = 1 - max_len / sized.kv_tokens
    return max(min(target, headroom), min(target, MIN_KV_USAGE_TARGET))


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
    # The PromQL window the percentiles and the arrival rate are computed over.
    rate_window_s: float = 60.0
    predictive: bool = False
    max_cold_start_s: float | None = None
    # Each engine's batch limit: requests running and waiting over it is the share of the
    # replicas' batches in use, a load measure that grows with the load (latency does not).
    max_num_seqs: int | None = None

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
            "kv_cache_usage_target_frac": kv_usage_target(resolved),
            "queue_target": scaling.queue_target,
            "tolerance": scaling.tolerance,
            "scale_up_stabilization_s": scaling.scale_up.stabilization.total_seconds(),
            "scale_up_max_rate": scaling.scale_up.max_rate,
            "scale_down_stabilization_s": scaling.scale_down.stabilization.total_seconds(),
            "scale_down_max_rate": scaling.scale_down.max_rate,
            "panic_window_s": max(scaling.window.total_seconds(), scaling.interval.total_seconds()),
            "rate_window_s": scaling.window.total_seconds(),
            "predictive": scaling.scale_up.predictive,
            "max_cold_start_s": (
                scaling.max_cold_start.total_seconds() if scaling.max_cold_start else None
            ),
            "max_data_age_s": 3 * scrape_interval_s,
            # A replica's batch limit: every data-parallel rank runs a batch of its own (the
            # running and waiting gauges are summed over them).
            "max_num_seqs": resolved.engine.max_num_seqs * resolved.parallelism.data,
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


# ------------------------------------------------------------------ the decision's middle steps


@dataclass(frozen=True)
class Signal:
    """One signal the role follows, usable now: its observed value against its target."""

    kind: ReasonKind  # TTFT, TPOT, KV_CACHE or QUEUE
    observed: float
    target: float

    @property
    def ratio(self) -> float:
        # A p95 beyond the histogram's last finite bucket reads +Inf: as overloaded as can be,
        # which the rate limit turns into one maximal step.
        if not math.isfinite(self.observed):
            return _MAX_RATIO
        return min(max(self.observed, 0.0) / self.target, _MAX_RATIO)


class GapKind(StrEnum):
    """Why a signal the role follows cannot be used now."""

    NO_VALUE = "no_value"  # the source has no value for it: missing data
    NO_COUNT = "no_count"  # a latency without its request count: missing data
    FEW_SAMPLES = "few_samples"  # a latency from fewer than min_samples requests: untrusted


@dataclass(frozen=True)
class Gap:
    """A signal the role follows that cannot be used now; any gap blocks a scale-down."""

    kind: ReasonKind
    why: GapKind
    samples: float = 0.0  # FEW_SAMPLES: how many there were
    min_samples: int = 0  # FEW_SAMPLES: how many a percentile needs

    @property
    def missing(self) -> bool:
        """Absent data (a data problem), as opposed to too few samples (an idle moment)."""
        return self.why is not GapKind.FEW_SAMPLES


# What the assessment found, one type per sentence of explain.why().


@dataclass(frozen=True)
class Unanswered:
    """The source could not be asked (unreachable, or it refused the query)."""

    detail: str


@dataclass(frozen=True)
class NoSeries:
    """The source answered, but without the engine series the role needs."""

    detail: str


@dataclass(frozen=True)
class NoReadyReplica:
    """Every replica is still starting: nothing exports metrics yet."""

    current: int


@dataclass(frozen=True)
class StaleSource:
    """The source itself called its data stale."""

    detail: str


@dataclass(frozen=True)
class OldData:
    """The newest sample is older than the policy trusts."""

    age_s: float
    max_age_s: float


@dataclass(frozen=True)
class WaitingAtZero:
    """A role at zero replicas with requests waiting for it."""

    waiting: float


@dataclass(frozen=True)
class ArrivingAtZero:
    """A role at zero replicas with requests arriving or running (seen upstream)."""

    arrival_rate_rps: float


@dataclass(frozen=True)
class NoDemand:
    """A role at zero replicas that nobody asks for."""


@dataclass(frozen=True)
class Unusable:
    """Data came, but no signal the role follows can be used."""

    gaps: tuple[Gap, ...]


@dataclass(frozen=True)
class Over:
    """The worst signal is above its target, beyond the tolerance."""

    worst: Signal


@dataclass(frozen=True)
class Within:
    """The worst signal lies within the tolerance of its target."""

    worst: Signal
    tolerance: float


@dataclass(frozen=True)
class Under:
    """Every signal is below its target, beyond the tolerance; a scale-down unless held."""

    worst: Signal
    signals: tuple[Signal, ...]
    held_by: tuple[Gap, ...] = ()  # signals that cannot be used hold a scale-down
    not_ready: int = 0  # as do replicas still starting (this many, of ``current``)
    current: int = 0


@dataclass(frozen=True)
class Idle:
    """Every signal reads zero: no requests at all, on fresh data."""

    signals: tuple[Signal, ...]


Finding = (
    Unanswered
    | NoSeries
    | NoReadyReplica
    | StaleSource
    | OldData
    | WaitingAtZero
    | ArrivingAtZero
    | NoDemand
    | Unusable
    | Over
    | Within
    | Under
    | Idle
)


@dataclass(frozen=True)
class Assessment:
    """The raw recommendation for one role, with what drove it and whether data was lacking."""

    replicas: int
    kind: ReasonKind
    finding: Finding
    problem: DataProblem | None = None
    worst_ratio: float | None = None


@dataclass(frozen=True)
class Sizing:
    """The steps from the raw recommendation to the replicas decided, for the explanation."""

    current: int
    stabilized: int  # after the stabilization windows
    limited: int  # after the max rates
    final: int  # after the bounds
    watched_s: float  # how long the role has been watched without a gap
    panic_left_s: float | None = None  # None: not in panic mode


__all__ = [
    "ArrivingAtZero",
    "Assessment",
    "DataProblem",
    "Decision",
    "Direction",
    "Finding",
    "Gap",
    "GapKind",
    "History",
    "Idle",
    "Metrics",
    "NoDemand",
    "NoReadyReplica",
    "NoSeries",
    "Observation",
    "OldData",
    "Over",
    "ReasonKind",
    "Recommendation",
    "RolePolicy",
    "Signal",
    "Sizing",
    "StaleSource",
    "Unanswered",
    "Under",
    "Unusable",
    "WaitingAtZero",
    "Within",
]
