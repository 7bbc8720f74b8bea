"""The direct /metrics source: Prometheus' quantile and window math, and a real engine."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleetpilot.autoscaler.direct import (
    EngineMetricsSource,
    Snapshot,
    histogram_quantile,
    increase,
    parse_snapshot,
    pending_requests,
    summarize,
    window_of,
)
from fleetpilot.autoscaler.model import DataProblem
from fleetpilot.runtime.processes import free_port
from fleetpilot.testing.engine_server import BackgroundServer

TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:inter_token_latency_seconds"
INF = math.inf


# ------------------------------------------------------------------------------ pure math


def test_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    """histogram_quantile gives what PromQL's would: linear inside the bucket, from zero in
    the first one, whatever order the buckets come in."""
    # rank 0.95 x 20 = 19 lies in (0.1, 0.2] holding observations 11..20: 0.1 + 0.1 x 9/10.
    assert histogram_quantile(0.95, [(0.1, 10), (0.2, 20), (INF, 20)]) == pytest.approx(0.19)
    # The first bucket interpolates from zero.
    assert histogram_quantile(0.5, [(1.0, 10), (INF, 10)]) == pytest.approx(0.5)
    # Unsorted input is sorted by le first.
    assert histogram_quantile(0.5, [(INF, 10), (1.0, 10)]) == pytest.approx(0.5)


def test_quantile_in_the_inf_bucket_is_the_largest_finite_bound() -> None:
    """A rank in the +Inf bucket reads the largest finite bound, as Prometheus answers."""
    assert histogram_quantile(0.95, [(0.5, 1), (1.0, 2), (INF, 10)]) == 1.0


def test_quantile_of_nothing_is_none() -> None:
    """No observations, no +Inf bucket or only one bucket: no percentile (PromQL's NaN),
    never 0, which would read as a fast engine."""
    assert histogram_quantile(0.95, [(0.1, 0), (INF, 0)]) is None
    assert histogram_quantile(0.95, [(0.1, 5), (0.2, 5)]) is None  # no +Inf bucket
    assert histogram_quantile(0.95, [(INF, 5)]) is None  # one bucket: Prometheus says NaN


def test_increase_treats_a_drop_as_a_counter_reset() -> None:
    """An engine that restarted resets its counters: the drop counts from zero, as
    PromQL's increase() does, instead of a negative rate."""
    assert increase([1, 5, 2, 4]) == 8  # +4, reset to 2 (+2), +2
    assert increase([3]) == 0
    assert increase([]) == 0


def snap(t: float, ttft: dict[float, float], *, kv: float = 0.0, waiting: float = 0.0) -> Snapshot:
    buckets = tuple(sorted(ttft.items()))
    return Snapshot(
        t,
        gauges={
            "vllm:kv_cache_usage_perc": kv,
            "vllm:num_requests_waiting": waiting,
            "vllm:num_requests_running": 1.0,
        },
        counters={"vllm:request_success_total": ttft[INF]},
        histograms={TTFT: buckets},
        counts={TTFT: ttft[INF]},
    )


def test_window_starts_at_the_newest_snapshot_before_it() -> None:
    """A window is measured from the newest snapshot at or before its start, so its
    increase covers the whole window; a younger series measures from its oldest."""
    series = [snap(t, {0.1: 0, INF: 0}) for t in (0, 5, 10, 15, 20)]
    assert [s.time_s for s in window_of(series, 20, 10)] == [10, 15, 20]
    assert [s.time_s for s in window_of(series, 20, 12)] == [5, 10, 15, 20]
    # A series shorter than the window measures from its oldest snapshot.
    assert [s.time_s for s in window_of(series[3:], 20, 60)] == [15, 20]


def test_summarize_sums_bucket_increases_across_engines() -> None:
    """Two engines, one restarted: bucket increases over the window are summed by le before
    the quantile, gauges are averaged or summed, and counts from before the window are left
    out."""
    # Engine a: 10 requests under 50ms in the window (20 before it, which must not count).
    a = [snap(0, {0.05: 20, 0.5: 20, INF: 20}), snap(10, {0.05: 30, 0.5: 30, INF: 30}, kv=0.2)]
    # Engine b: 10 requests between 50ms and 500ms, after a restart (counters reset).
    b = [snap(0, {0.05: 7, 0.5: 15, INF: 15}), snap(10, {0.05: 0, 0.5: 10, INF: 10}, kv=0.6)]
    b[1] = Snapshot(12, b[1].gauges, b[1].counters, b[1].histograms, b[1].counts)
    m = summarize({"a": a, "b": b}, now_s=13, window_s=13)
    assert m.problem is None
    assert m.ttft_samples == 20
    # Summed: le 0.05 -> 10, le 0.5 -> 20; rank 19 -> 0.05 + 0.45 x 9/10.
    assert m.ttft_p95_s == pytest.approx(0.05 + 0.45 * 0.9)
    assert m.kv_cache_usage_frac == pytest.approx(0.4)
    assert m.waiting_requests == 0
    assert m.running_requests == 2
    assert m.reporting_engines == 2
    assert m.arrival_rate_rps == pytest.approx(20 / 13)
    assert m.data_age_s == pytest.approx(1.0)
    assert m.tpot_samples == 0
    assert m.tpot_p95_s is None


def test_the_hit_rate_counts_the_host_tiers_hits_past_the_devices() -> None:
    """Engine a has a host tier (the connector's counter), engine b none: (30 + 20 + 10) of
    200 prompt tokens were hits."""

    def with_prefix(s: Snapshot, queries: float, hits: float, external: float | None) -> Snapshot:
        counters = {
            **s.counters,
            "vllm:prefix_cache_queries_total": queries,
            "vllm:prefix_cache_hits_total": hits,
        }
        if external is not None:
            counters["vllm:external_prefix_cache_hits_total"] = external
        return Snapshot(s.time_s, s.gauges, counters, s.histograms, s.counts)

    base = {0.1: 0, INF: 0}
    a = [with_prefix(snap(0, base), 0, 0, 0), with_prefix(snap(10, base), 100, 30, 20)]
    b = [with_prefix(snap(0, base), 0, 0, None), with_prefix(snap(10, base), 100, 10, None)]
    m = summarize({"a": a, "b": b}, now_s=10, window_s=10)
    assert m.prefix_hit_rate_frac == pytest.approx(0.3)


def test_one_snapshot_per_engine_gives_no_latency_and_no_count() -> None:
    """A first scrape has nothing to take an increase from: latency and count are absent
    (the policy then holds), while the gauges are already usable."""
    m = summarize({"a": [snap(0, {0.1: 5, INF: 5}, waiting=3)]}, now_s=1, window_s=10)
    assert m.problem is None
    assert m.ttft_p95_s is None
    assert m.ttft_samples is None
    assert m.waiting_requests == 3
    assert m.data_age_s == pytest.approx(1.0)


def test_parse_snapshot_reads_both_spellings_and_sums_label_sets() -> None:
    """The exposition parser reads ``vllm:x`` and ``vllm_x`` as one metric and sums its
    label sets (engines, finish reasons) into one value per bucket or counter."""
    registry = CollectorRegistry()
    h = Histogram(TTFT, "ttft", ["engine"], buckets=(0.1, 1.0), registry=registry)
    h.labels("0").observe(0.05)
    h.labels("1").observe(0.5)
    Gauge("vllm_num_requests_waiting", "w", ["engine"], registry=registry).labels("0").set(4)
    c = Counter("vllm:request_success", "ok", ["finished_reason"], registry=registry)
    c.labels("stop").inc(2)
    c.labels("length").inc(3)
    s = parse_snapshot(generate_latest(registry).decode(), 7.0)
    assert s.time_s == 7.0
    assert s.histograms[TTFT] == ((0.1, 1.0), (1.0, 2.0), (INF, 2.0))
    assert s.counts[TTFT] == 2
    assert s.gauges["vllm:num_requests_waiting"] == 4
    assert s.counters["vllm:request_success_total"] == 5


def test_unreachable_engines_are_a_data_problem_not_an_exception() -> None:
    """An engine that does not answer makes the observation UNREACHABLE, naming it."""
    port = free_port()
    with EngineMetricsSource(lambda tier, role: [f"127.0.0.1:{port}"], timeout_s=0.5) as source:
        m = source.observe("svc", "small", "unified", timedelta(seconds=10), namespace=None)
    assert m.problem is DataProblem.UNREACHABLE
    assert f"127.0.0.1:{port}" in m.detail


def test_no_engines_and_a_failing_address_book_are_data_problems() -> None:
    """No engine to scrape is MISSING; an address book that raises (a fleet stopping) is
    UNREACHABLE with its message: neither escapes as an exception."""

    def broken(tier: str, role: str) -> list[str]:
        raise RuntimeError("fleet is stopping")

    window = timedelta(seconds=10)
    with EngineMetricsSource(lambda tier, role: []) as source:
        assert source.observe("s", "t", "unified", window).problem is DataProblem.MISSING
    with EngineMetricsSource(broken) as source:
        m = source.observe("s", "t", "unified", window)
    assert m.problem is DataProblem.UNREACHABLE
    assert "fleet is stopping" in m.detail


# ------------------------------------------------------------------------------ a real engine


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    argv = ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny",
            "--max-model-len", "512", "--served-model-name", "m"]  # fmt: skip
    srv = BackgroundServer.from_argv(argv).start()
    yield srv
    srv.stop()


def test_scraping_a_real_engine_measures_the_requests_of_the_window(engine: Any) -> None:
    """Against the reference engine: the requests sent between two scrapes are counted and
    timed, and once they leave the window they are no longer counted."""
    address = httpx.URL(engine.url).netloc.decode()
    clock = [1000.0]
    with EngineMetricsSource(lambda tier, role: [address], clock=lambda: clock[0]) as source:
        window = timedelta(seconds=30)
        first = source.observe("s", "t", "unified", window)
        assert first.problem is None
        assert first.ttft_samples is None
        with httpx.Client(base_url=engine.url, timeout=30) as client:
            for i in range(12):
                r = client.post(
                    "/v1/completions", json={"model": "m", "prompt": f"hi {i}", "max_tokens": 3}
                )
                r.raise_for_status()
        clock[0] += 5
        second = source.observe("s", "t", "unified", window)
        assert second.problem is None, second.detail
        assert second.ttft_samples == 12
        assert second.ttft_p95_s is not None
        assert 0 < second.ttft_p95_s < 10
        assert second.tpot_samples is not None
        assert second.tpot_samples >= 12
        assert second.waiting_requests == 0
        assert second.kv_cache_usage_frac is not None
        assert second.reporting_engines == 1
        assert second.data_age_s == 0
        assert second.arrival_rate_rps == pytest.approx(12 / 30)
        # Once the requests have left the window, none are counted.
        clock[0] += 40
        source.observe("s", "t", "unified", window)
        clock[0] += 1
        later = source.observe("s", "t", "unified", window)
        assert later.ttft_samples == 0
        assert later.ttft_p95_s is None


ROUTER_EXPOSITION = """\
# HELP fleetpilot_router_pending_requests Requests held because their tier has no replica.
# TYPE fleetpilot_router_pending_requests gauge
fleetpilot_router_pending_requests{role="unified",tier="small"} 3.0
fleetpilot_router_pending_requests{role="decode",tier="large"} 1.0
fleetpilot_router_pending_requests{role="prefill",tier="large"} 1.0
"""


def test_pending_requests_are_read_per_tier_and_role() -> None:
    """The router's held requests are read for one tier and role; a role it does not list
    holds none."""
    assert pending_requests(ROUTER_EXPOSITION, "small", "unified") == 3.0
    assert pending_requests(ROUTER_EXPOSITION, "large", "decode") == 1.0
    assert pending_requests(ROUTER_EXPOSITION, "small", "decode") == 0.0
    assert pending_requests("", "small", "unified") == 0.0
