"""What cold starts mean for scaling: the arrival rate projected over the time a new replica
takes to serve, and the words that say so. Purely computational.

A replica added now serves only after the role's observed cold start (pod created to Ready,
``status.tiers[].roles[].coldStart``). A reactive scale-up on a rising load is therefore always
that late; the predictive one sizes the role for the arrival rate expected when the replica
would be ready: the least-squares trend of the recent arrival rates, extended over the cold
start plus half the rate window (the rate is a mean over that window, so it describes the
load of half a window ago).
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
    if arrivals[-1][0] - arrivals[0][0] < 2 * interval_s - 1e-9:
        return None
    rise = slope(arrivals)
    rate = arrivals[-1][1]
    if rise is None or rise <= 0 or rate <= 0:
        return None
    horizon = cold_start_s + rate_window_s / 2
    projected = rate + rise * horizon
    if projected < rate * (1 + MIN_GROWTH):
        return None
    return Projection(rate, projected, horizon)


def ahead_of(replicas: int, projection: Projection) -> int:
    """Replicas for the projected rate, from those the current rate needs."""
    return math.ceil(max(replicas, 1) * projection.growth - 1e-9)
