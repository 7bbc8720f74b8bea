"""What cold starts mean for scaling: the arrival rate projected over the time a new replica
takes to serve, and the words that say so. Purely computational.

A replica added now serves only after the role's observed cold start (pod created to Ready,
``status.tiers[].roles[].coldStart``). A reactive scale-up on a rising load is therefore always
that late; the predictive one sizes the role for the arrival rate expected when the replica
would be ready: the least-squares trend of the recent arrival rates, extended over the cold
start plus half the rate window (the rate is a mean over that window, so it describes the
load of half a window ago).

How many replicas that rate needs: latency is not linear in load (a role at half its capacity
shows a TTFT far below half its objective, and at capacity a queue that grows without bound),
so the signals' ratio says little about the replicas a higher rate needs. The rate itself
does: when the role runs at (or past) its objective, the requests/s each ready replica serves
is what one replica can carry (:class:`ReplicaCapacity`; the arrival rate is the completion
rate, which at saturation is the throughput), and the projected rate over that capacity is the
answer. Until the role has been seen at its objective, its load is read as a fraction of what
the ready replicas carry - the worst signal's ratio, or the share of their batches in use
(requests running and waiting over ``ready x maxNumSeqs``, which grows with the load where
latency stays flat until a queue forms), whichever is higher - and grown with the rate:
``ready x load x growth``. Both underestimate at light load (vLLM's batches seldom fill), the
cautious side. A load that starts from idle is a step, which a windowed rate shows as a rise
lasting one window, from a tiny rate: a huge "growth" times a tiny load, which asked for one
replica more in bench/autoscale_ramp.py (1 -> 2 for 2 req/s); scaling the current
recommendation by the growth instead asked for 1 -> 6, as a recommendation is at least 1
however light the load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The trend is read from this many recent arrival rates (one per decision), and only once at
# least MIN_POINTS of them span at least two decision intervals: two points are any line.
TREND_POINTS = 6
MIN_POINTS = 3
# A projection that adds less than this fraction to the current rate is noise, not a ramp.
MIN_GROWTH = 0.1
# Requests counted over a window of w seconds at r req/s are Poisson: the rate read from them
# varies by sqrt(r / w) at a steady load (1.4 req/s at 20 req/s over 10 s). A trend must rise
# by this many of those over its points, or steady traffic would "ramp" now and then and
# add replicas at steady state (seen in bench/autoscale_ramp.py before this bound).
NOISE_SIGMAS = 2.0
# A replica's capacity seen longer ago than this may no longer hold: prompts and answers change.
CAPACITY_MAX_AGE_S = 900.0


@dataclass(frozen=True)
class ReplicaCapacity:
    """Requests/s one ready replica served while the role was at or past its objective: the
    highest seen within ``CAPACITY_MAX_AGE_S`` (lower readings come from a rate window that
    still averages in the time before replicas joined)."""

    time_s: float
    rps_per_replica: float

    def fresh(self, now_s: float) -> bool:
        return now_s - self.time_s <= CAPACITY_MAX_AGE_S


@dataclass(frozen=True)
class Projection:
    """The arrival rate now and where its trend puts it ``horizon_s`` later."""

    rate_rps: float
    projected_rps: float
    horizon_s: float

    @property
    def growth(self) -> float:
        return self.projected_rps / self.rate_rps


def keep_arrivals(
    arrivals: tuple[tuple[float, float], ...], rate_rps: float | None, now_s: float
) -> tuple[tuple[float, float], ...]:
    """The last ``TREND_POINTS`` arrival rates, with this decision's (when the source had one)."""
    if rate_rps is None or not math.isfinite(rate_rps):
        return arrivals[-TREND_POINTS:]
    return (*arrivals, (now_s, rate_rps))[-TREND_POINTS:]


def slope(points: tuple[tuple[float, float], ...]) -> float | None:
    """Least-squares slope (requests/s per second) of (time, rate) points; None for fewer than
    two distinct times."""
    if len(points) < 2:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_r = sum(r for _, r in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread <= 0:
        return None
    return sum((t - mean_t) * (r - mean_r) for t, r in points) / spread


def project(
    arrivals: tuple[tuple[float, float], ...],
    cold_start_s: float | None,
    rate_window_s: float,
    interval_s: float,
) -> Projection | None:
    """Where the arrival rate is heading by the time a replica started now would serve; None
    without a cold start observed, without enough recent rates, or without a rise."""
    if cold_start_s is None or len(arrivals) < MIN_POINTS:
        return None
    span = arrivals[-1][0] - arrivals[0][0]
    if span < 2 * interval_s - 1e-9:
        return None
    rise = slope(arrivals)
    rate = arrivals[-1][1]
    if rise is None or rise <= 0 or rate <= 0:
        return None
    if rise * span < NOISE_SIGMAS * math.sqrt(rate / rate_window_s):
        return None  # a steady load's counting noise, not a ramp
    horizon = cold_start_s + rate_window_s / 2
    projected = rate + rise * horizon
    if projected < rate * (1 + MIN_GROWTH):
        return None
    return Projection(rate, projected, horizon)


def observe_capacity(
    previous: ReplicaCapacity | None,
    rate_rps: float | None,
    ready: int,
    worst_ratio: float | None,
    tolerance: float,
    now_s: float,
) -> ReplicaCapacity | None:
    """The capacity kept after this decision: this one's rate per ready replica when the role
    is at its objective (worst ratio at least ``1 - tolerance``) and it beats the one kept
    (or that one is too old)."""
    at_objective = worst_ratio is not None and worst_ratio >= 1 - tolerance
    if not at_objective or ready <= 0 or rate_rps is None or not math.isfinite(rate_rps):
        return previous
    if rate_rps <= 0:
        return previous
    seen = ReplicaCapacity(now_s, rate_rps / ready)
    if seen.rps_per_replica <= 0:  # underflowed: no reading
        return previous
    if previous is None or not previous.fresh(now_s):
        return seen
    return seen if seen.rps_per_replica >= previous.rps_per_replica else previous


def load_fraction(
    worst_ratio: float, running: float | None, waiting: float | None, ready: int, batch: int | None
) -> float:
    """How loaded the ready replicas are, 1 at their objective: the worst signal's ratio, or
    the share of their batches in use when that is higher (and known)."""
    if batch is None or ready <= 0 or running is None:
        return worst_ratio
    return max(worst_ratio, (running + (waiting or 0.0)) / (ready * batch))


def needed_now(
    rate_rps: float | None, capacity: ReplicaCapacity | None, now_s: float
) -> int | None:
    """Replicas the current arrival rate needs at one replica's capacity; None when the rate
    or a fresh capacity is unknown, or nothing arrives."""
    if rate_rps is None or not math.isfinite(rate_rps) or rate_rps <= 0:
        return None
    # A capacity of 0 (a rate so small that its share per replica underflowed) says nothing.
    if capacity is None or not capacity.fresh(now_s) or capacity.rps_per_replica <= 0:
        return None
    return math.ceil(rate_rps / capacity.rps_per_replica - 1e-9)


def ahead_of(
    projection: Projection,
    capacity: ReplicaCapacity | None,
    ready: int,
    load: float,
    now_s: float,
) -> int:
    """Replicas for the projected rate: over one replica's capacity when a fresh one is known,
    else the ``ready`` replicas' ``load`` (:func:`load_fraction`) grown with the rate."""
    needed = needed_now(projection.projected_rps, capacity, now_s)
    if needed is not None:
        return needed
    return math.ceil(ready * load * projection.growth - 1e-9)
