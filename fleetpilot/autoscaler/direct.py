"""Reading what the policy needs straight from the engines' ``/metrics``, without Prometheus.

The local runtime has no Prometheus unless one is installed; this source scrapes each engine
of a role when asked (``observe``) and keeps a short time series per engine in memory, so the
windowed values come out as the PromQL of :mod:`fleetpilot.autoscaler.prometheus` would give
them:

- TTFT / TPOT p95: per engine, the increase of every ``_bucket`` series over the window
  (counter resets handled as ``increase`` does), summed by ``le`` across engines, then
  :func:`histogram_quantile` (Prometheus' linear interpolation inside the bucket);
- samples: the increase of ``_count``; arrival rate: the increase of
  ``vllm:request_success_total`` over the window, per second;
- KV usage: mean of the engines' latest gauges; waiting / running: their sum;
- data age: time since the newest successful scrape.

A window is measured between the newest snapshot at or before its start (else the oldest one
kept) and the latest, so the observation interval must be shorter than the window for a rate
to exist. An engine seen once has no increase yet; when no engine has two snapshots the
latency fields are None (the policy then holds: "no request count"), never a guess.

A role with no engines (scaled to zero) has nothing to scrape; when the source knows the
router's address it reads the requests the router holds for the role
(``fleetpilot_router_pending_requests``) as its waiting requests, which is what scales it from
zero.

An engine that does not answer is left out and named in ``detail``; when none answers the
observation is :attr:`DataProblem.UNREACHABLE`. Nothing here raises for a data problem.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import timedelta

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.autoscaler.model import DataProblem, Metrics
from fleetpilot.autoscaler.prometheus import (
    QUANTILE,
    ROUTER_PENDING_METRIC,
    MetricNames,
    escaped_name,
)

log = logging.getLogger(__name__)

# Two seconds: an engine busy on a loaded CPU still answers /metrics within it, and a tick of
# one second waits at most this long on a hung engine (scrapes run in parallel).
DEFAULT_SCRAPE_TIMEOUT_S = 2.0

# (tier, role) -> engine addresses ("host:port"), as the runtime knows them now.
AddressBook = Callable[[str, str], Sequence[str]]

Buckets = tuple[tuple[float, float], ...]  # ((le, cumulative count), ...) sorted by le


# ------------------------------------------------------------------------------ pure helpers


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``(le, count)`` pairs.

    Written here because this reader runs exactly when no Prometheus answers, and no library
    we ship evaluates PromQL; the rules follow Prometheus' own implementation.

    None where Prometheus gives NaN (no observations, or no ``+Inf`` bucket). Within the
    bucket holding the rank the value is interpolated linearly (the first bucket from 0); a
    rank in the ``+Inf`` bucket answers the largest finite bound, as Prometheus does.
    """
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        return None
    # Cumulative counts summed from increases may dip by float noise: force them monotonic.
    cumulative: list[tuple[float, float]] = []
    running = 0.0
    for le, count in ordered:
        running = max(running, count)
        cumulative.append((le, running))
    total = cumulative[-1][1]
    if total <= 0:
        return None
    rank = q * total
    for i, (le, count) in enumerate(cumulative):
        if count >= rank:
            if math.isinf(le):
                return cumulative[-2][0]
            lower, below = (0.0, 0.0) if i == 0 else cumulative[i - 1]
            if i == 0 and le <= 0:
                return le
            in_bucket = count - below
            if in_bucket <= 0:
                return le
            return lower + (le - lower) * (rank - below) / in_bucket
    return cumulative[-2][0]


def increase(values: Sequence[float]) -> float:
    """``increase`` of one counter over consecutive samples: a drop is a reset from zero."""
    total = 0.0
    for before, after in itertools.pairwise(values):
        total += after - before if after >= before else after
    return total


@dataclass(frozen=True)
class Snapshot:
    """One scrape of one engine, reduced to what the policy reads."""

    time_s: float
    gauges: Mapping[str, float] = field(default_factory=dict)  # summed over label sets
    counters: Mapping[str, float] = field(default_factory=dict)
    histograms: Mapping[str, Buckets] = field(default_factory=dict)  # by histogram name
    counts: Mapping[str, float] = field(default_factory=dict)  # histogram _count


def window_of(series: Sequence[Snapshot], now_s: float, window_s: float) -> list[Snapshot]:
    """The snapshots measuring ``[now - window, now]``: from the newest one at or before the
    start (else the oldest kept) to the latest. Purely computational."""
    start = now_s - window_s
    first = 0
    for i, snap in enumerate(series):
        if snap.time_s <= start:
            first = i
    return [s for s in series[first:] if s.time_s <= now_s]


def bucket_increase(snaps: Sequence[Snapshot], histogram: str) -> dict[float, float]:
    """Per ``le``, the increase of one engine's bucket counter across ``snaps``."""
    per_le: dict[float, list[float]] = {}
    for snap in snaps:
        for le, count in snap.histograms.get(histogram, ()):
            per_le.setdefault(le, []).append(count)
    return {le: increase(values) for le, values in per_le.items()}


def parse_snapshot(text: str, time_s: float, names: MetricNames | None = None) -> Snapshot:
    """Reduce a Prometheus text exposition to a :class:`Snapshot` (colon or escaped names)."""
    n = names or MetricNames()
    wanted_gauges = {n.kv_cache_usage, n.waiting, n.running}
    wanted_counters = {n.success, n.prefix_hits, n.prefix_queries}
    wanted_histograms = {n.ttft_histogram, n.tpot_histogram}
    # Accept the escaped spelling of each name too (see prometheus.escaped_name).
    canonical = {
        escaped_name(name): name for name in wanted_gauges | wanted_counters | wanted_histograms
    }
    canonical.update({name: name for name in wanted_gauges | wanted_counters | wanted_histograms})
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            base = canonical.get(name)
            if base in wanted_gauges:
                gauges[base] = gauges.get(base, 0.0) + sample.value
                continue
            if base in wanted_counters:
                counters[base] = counters.get(base, 0.0) + sample.value
                continue
            for suffix in ("_bucket", "_count"):
                if not name.endswith(suffix):
                    continue
                hist = canonical.get(name.removesuffix(suffix))
                if hist not in wanted_histograms:
                    continue
                if suffix == "_count":
                    counts[hist] = counts.get(hist, 0.0) + sample.value
                else:
                    le = float(sample.labels["le"])
                    per_le = buckets.setdefault(hist, {})
                    per_le[le] = per_le.get(le, 0.0) + sample.value
    return Snapshot(
        time_s,
        gauges,
        counters,
        {h: tuple(sorted(b.items())) for h, b in buckets.items()},
        counts,
    )


def summarize(
    series_by_engine: Mapping[str, Sequence[Snapshot]],
    now_s: float,
    window_s: float,
    names: MetricNames | None = None,
) -> Metrics:
    """The :class:`Metrics` of one role from its engines' snapshots. Purely computational.

    Only engines whose latest snapshot is in ``series_by_engine`` count; the caller drops the
    ones that did not answer this time.
    """
    n = names or MetricNames()
    windows = {
        engine: window_of(series, now_s, window_s)
        for engine, series in series_by_engine.items()
        if series
    }
    windows = {engine: snaps for engine, snaps in windows.items() if snaps}
    if not windows:
        return Metrics(problem=DataProblem.MISSING, detail="no engine answered /metrics")
    latest = [snaps[-1] for snaps in windows.values()]
    rated = {engine: snaps for engine, snaps in windows.items() if len(snaps) >= 2}

    def quantile_and_samples(histogram: str) -> tuple[float | None, float | None]:
        if not rated:
            return None, None  # one scrape per engine: no increase can be measured yet
        summed: dict[float, float] = {}
        samples = 0.0
        for snaps in rated.values():
            for le, inc in bucket_increase(snaps, histogram).items():
                summed[le] = summed.get(le, 0.0) + inc
            samples += increase([s.counts.get(histogram, 0.0) for s in snaps])
        return histogram_quantile(QUANTILE, summed.items()), samples

    def counter_increase(counter: str) -> float:
        return sum(
            increase([s.counters.get(counter, 0.0) for s in snaps]) for snaps in rated.values()
        )

    ttft, ttft_samples = quantile_and_samples(n.ttft_histogram)
    tpot, tpot_samples = quantile_and_samples(n.tpot_histogram)
    kv = [s.gauges[n.kv_cache_usage] for s in latest if n.kv_cache_usage in s.gauges]
    waiting = [s.gauges[n.waiting] for s in latest if n.waiting in s.gauges]
    running = [s.gauges[n.running] for s in latest if n.running in s.gauges]
    arrival = counter_increase(n.success) / window_s if rated else None
    queries = counter_increase(n.prefix_queries) if rated else 0.0
    hits = counter_increase(n.prefix_hits) + counter_increase(n.external_prefix_hits)
    hit_rate = hits / queries if queries > 0 else None
    detail = "" if rated else "one scrape per engine so far: no rates yet"
    return Metrics(
        ttft_p95_s=ttft,
        ttft_samples=ttft_samples,
        tpot_p95_s=tpot,
        tpot_samples=tpot_samples,
        kv_cache_usage_frac=sum(kv) / len(kv) if kv else None,
        waiting_requests=sum(waiting) if waiting else None,
        running_requests=sum(running) if running else None,
        reporting_engines=len(latest),
        prefix_hit_rate_frac=hit_rate,
        arrival_rate_rps=arrival,
        data_age_s=max(0.0, now_s - max(s.time_s for s in latest)),
        detail=detail,
    )


def pending_requests(text: str, tier: str, role: str) -> float:
    """``fleetpilot_router_pending_requests{tier, role}`` from a router's exposition."""
    for family in text_string_to_metric_families(text):
        if family.name != ROUTER_PENDING_METRIC:
            continue
        return sum(
            s.value
            for s in family.samples
            if s.labels.get("tier") == tier and s.labels.get("role") == role
        )
    return 0.0


# ------------------------------------------------------------------------------ the source


class EngineMetricsSource:
    """:class:`~fleetpilot.autoscaler.prometheus.MetricsSource` over the engines' /metrics.

    ``addresses(tier, role)`` names the role's engines now; ``service`` and ``namespace`` of
    ``observe`` are ignored (one source serves one local fleet). ``clock`` is injectable for
    tests. Thread-safe: roles of one tick are observed concurrently.
    """

    def __init__(
        self,
        addresses: AddressBook,
        *,
        timeout_s: float = DEFAULT_SCRAPE_TIMEOUT_S,
        names: MetricNames | None = None,
        clock: Callable[[], float] = time.time,
        max_workers: int = 8,
        router: Callable[[], str | None] | None = None,
    ) -> None:
        self.addresses = addresses
        self.router = router
        self.timeout_s = timeout_s
        self.names = names or MetricNames()
        self.clock = clock
        self._series: dict[str, deque[Snapshot]] = {}
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=timeout_s, trust_env=False)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="scrape")
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def reset(self) -> None:
        """Forget every kept snapshot. A source asked only now and then (a fallback) must
        not measure a window from a baseline older than it: the increase since then would
        count as the window's."""
        with self._lock:
            self._series.clear()

    def __enter__(self) -> EngineMetricsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def scrape(self, address: str) -> Snapshot | str:
        """One engine's snapshot, or why there is none (never raises)."""
        url = f"http://{address}/metrics"
        try:
            response = self._client.get(url)
            response.raise_for_status()
            return parse_snapshot(response.text, self.clock(), self.names)
        except httpx.HTTPError as exc:
            return f"{address}: {type(exc).__name__} {exc}".strip()
        except Exception as exc:  # a garbled exposition is no data, not a crashed tick
            return f"{address}: unreadable metrics ({exc})"

    def router_pending(self, tier: str, role: str) -> float | None:
        """Requests the router holds for the role (cold start); None when unknown."""
        address = self.router() if self.router is not None else None
        if not address:
            return None
        try:
            response = self._client.get(f"http://{address}/metrics")
            response.raise_for_status()
            return pending_requests(response.text, tier, role)
        except Exception as exc:  # no router reading is no demand seen, never a crash
            log.debug("router %s: %s", address, exc)
            return None

    def observe(
        self,
        service: str,
        tier: str,
        role: str,
        window: timedelta,
        *,
        namespace: str | None = None,
    ) -> Metrics:
        if self._closed:
            return Metrics(problem=DataProblem.UNREACHABLE, detail="metrics source is closed")
        try:
            engines = list(self.addresses(tier, role))
        except Exception as exc:
            return Metrics(problem=DataProblem.UNREACHABLE, detail=f"no engine addresses: {exc}")
        if not engines:
            # No engines: a role at zero replicas. Demand shows at the router, if anywhere.
            return Metrics(
                waiting_requests=self.router_pending(tier, role),
                problem=DataProblem.MISSING,
                detail=f"tier {tier} {role}: no engines",
            )
        results = list(self._pool.map(self.scrape, engines))
        window_s = max(window.total_seconds(), 1e-3)
        now_s = self.clock()
        answered: dict[str, Sequence[Snapshot]] = {}
        failures: list[str] = []
        with self._lock:
            for address, result in zip(engines, results, strict=True):
                if isinstance(result, str):
                    failures.append(result)
                    continue
                series = self._series.setdefault(address, deque())
                series.append(result)
                # Keep one snapshot before the window (the baseline) and the window itself.
                while len(series) >= 2 and series[1].time_s <= now_s - window_s:
                    series.popleft()
                answered[address] = list(series)
            # Engines gone for long (scaled down, replaced on another port) are forgotten.
            for address in [
                a for a, s in self._series.items() if s and s[-1].time_s < now_s - 10 * window_s
            ]:
                del self._series[address]
        if not answered:
            return Metrics(
                problem=DataProblem.UNREACHABLE,
                detail=f"no engine of tier {tier} {role} answered: {'; '.join(failures)}",
            )
        metrics = summarize(answered, now_s, window_s, self.names)
        if failures:
            note = f"unreachable: {'; '.join(failures)}"
            detail = f"{metrics.detail}; {note}" if metrics.detail else note
            metrics = replace(metrics, detail=detail)
        return metrics


__all__ = [
    "DEFAULT_SCRAPE_TIMEOUT_S",
    "AddressBook",
    "EngineMetricsSource",
    "Snapshot",
    "bucket_increase",
    "histogram_quantile",
    "increase",
    "parse_snapshot",
    "pending_requests",
    "summarize",
    "window_of",
]
