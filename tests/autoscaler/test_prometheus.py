"""The Prometheus reader against a real Prometheus scraping fake vLLM engines.

The engines (conftest.py) observe a fixed pattern every 100 ms, so the expected percentiles
follow from vLLM's bucket bounds by Prometheus' own interpolation; gauges are set outright.
Failures (Prometheus down or hanging, a PromQL error, no series) must come back as "no data"
with a reason, quickly, and never as an exception.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from fleetpilot.autoscaler.model import DataProblem, History, Metrics, Observation
from fleetpilot.autoscaler.model import RolePolicy as Policy
from fleetpilot.autoscaler.policy import decide
from fleetpilot.autoscaler.prometheus import (
    LabelNames,
    MetricNames,
    PrometheusSource,
    PrometheusSources,
    QueryResult,
    combine,
    promql_duration,
    queries,
    router_queries,
    selector,
)
from fleetpilot.runtime.processes import free_ports
from fleetpilot.testing.polling import eventually
from tests.autoscaler.support import Fleet, Load

WINDOW = timedelta(seconds=3)
SCRAPE_S = 1.0
# Per engine and 100 ms: 90% fast first tokens, 10% slow; the p95 lies in the slow bucket,
# (1.0, 2.5], halfway: 1.0 + 1.5 x (0.95 - 0.90) / 0.10 = 1.75 s.
READER_LOAD = Load(
    ttft_s=(0.05,) * 9 + (1.5,),
    itl_s=(0.02,) * 9 + (0.08,),  # p95 in (0.075, 0.1], halfway: 0.0875 s
    successes=10,
    prefix_queries=100,
    prefix_hits=25,
    # A host tier's 15 more a tick: both engines alike, so the fleet's ratio is theirs however
    # many ticks of each the window holds (test_direct.py mixes engines with and without).
    external_prefix_hits=15,
)
# all in (0.25, 0.5]: p95 0.4875 s; no host tier (no external hits series at all)
PREFILL_LOAD = Load(ttft_s=(0.3,) * 20, successes=20, prefix_queries=40, prefix_hits=10)
DECODE_LOAD = Load(itl_s=(0.04,) * 50, successes=5)  # all in (0.025, 0.05]: p95 0.04875 s


@pytest.fixture(scope="module")
def driven(fleet: Fleet) -> Iterator[Fleet]:
    """The reader's engines under steady load, for the whole module."""
    first, second = fleet.of("ml", "reader", "small", "unified")
    first.set(kv=0.5, waiting=3, running=4)
    second.set(kv=0.7, waiting=5, running=6)
    for engine in (first, second):
        engine.drive(READER_LOAD)
    (stranger,) = fleet.of("other", "reader", "small", "unified")
    stranger.set(kv=0.99, waiting=100, running=50)
    stranger.drive(Load(ttft_s=(30.0,) * 10, successes=100))
    (prefill,) = fleet.of("ml", "reader", "large", "prefill")
    prefill.set(kv=0.1, waiting=7)
    prefill.drive(PREFILL_LOAD)
    (decode,) = fleet.of("ml", "reader", "large", "decode")
    decode.set(kv=0.9, running=40)
    decode.drive(DECODE_LOAD)
    (idle,) = fleet.of("ml", "idle", "small", "unified")
    idle.set(kv=0.0)
    # Rates are steady once the whole window has seen the load, plus a scrape either side.
    time.sleep(WINDOW.total_seconds() + 2 * SCRAPE_S)
    yield fleet
    for engines in fleet.engines.values():
        for engine in engines:
            engine.drive(None)


@pytest.fixture(scope="module")
def source(driven: Fleet) -> Iterator[PrometheusSource]:
    with PrometheusSource(driven.prometheus.url, timeout_s=5.0) as src:
        yield src


def settled(read: Callable[[], Metrics], ok: Callable[[Metrics], bool]) -> Metrics:
    """Read until ``ok`` (rates need two scrapes inside the window after the load starts)."""
    return eventually("settled rates", read, 20.0, until=ok)


def _full(m: Metrics) -> bool:
    return m.arrival_rate_rps is not None and m.arrival_rate_rps > 180


def test_reads_percentiles_gauges_and_rates(source: PrometheusSource) -> None:
    """p95 TTFT/TPOT from the buckets, mean KV usage, summed queue, arrival and prefix-hit
    rates, over two engines of which one writes its colons as underscores (client_python
    #1177); the same names in another namespace are not mixed in. The hit rate counts the
    device's and the host tier's hits: (25 + 15) / 100."""
    m = settled(lambda: source.observe("reader", "small", "unified", WINDOW, namespace="ml"), _full)
    assert m.problem is None, m.detail
    assert m.ttft_p95_s == pytest.approx(1.75, rel=0.03)
    assert m.tpot_p95_s == pytest.approx(0.0875, rel=0.03)
    assert m.kv_cache_usage_frac == pytest.approx(0.6)
    assert m.waiting_requests == 8
    assert m.running_requests == 10
    assert m.reporting_engines == 2
    # 2 engines x 10 requests per 100 ms (the driver's period stretches a little under load).
    assert m.arrival_rate_rps == pytest.approx(200, rel=0.2)
    assert m.ttft_samples == pytest.approx(200 * WINDOW.total_seconds(), rel=0.25)
    assert m.prefix_hit_rate_frac == pytest.approx(0.40)
    assert m.data_age_s is not None
    assert 0 <= m.data_age_s < 3


def test_roles_are_read_apart(source: PrometheusSource) -> None:
    """Prefill and decode engines of one tier are separate observations."""

    def has(attr: str) -> Callable[[Metrics], bool]:
        return lambda m: getattr(m, attr) is not None and m.arrival_rate_rps is not None

    prefill = settled(
        lambda: source.observe("reader", "large", "prefill", WINDOW, namespace="ml"),
        has("ttft_p95_s"),
    )
    decode = settled(
        lambda: source.observe("reader", "large", "decode", WINDOW, namespace="ml"),
        has("tpot_p95_s"),
    )
    assert prefill.ttft_p95_s == pytest.approx(0.4875, rel=0.01)
    assert prefill.waiting_requests == 7
    assert prefill.tpot_p95_s is None  # no inter-token latencies on prefill engines
    assert prefill.tpot_samples == 0
    # Device hits only: no engine of the role exports the connector's counter.
    assert prefill.prefix_hit_rate_frac == pytest.approx(0.25)
    assert decode.tpot_p95_s == pytest.approx(0.04875, rel=0.01)
    assert decode.kv_cache_usage_frac == pytest.approx(0.9)
    assert decode.ttft_p95_s is None
    assert decode.ttft_samples == 0
    assert "ttft_p95_s: no observations in the window" in decode.detail


def test_an_idle_role_is_fresh_with_zero_samples(source: PrometheusSource) -> None:
    """No requests: the latency percentiles are absent, yet the data is fresh, which lets
    the policy shrink an idle role (as opposed to a role without metrics)."""
    m = source.observe("idle", "small", "unified", WINDOW, namespace="ml")
    assert m.problem is None
    assert m.ttft_p95_s is None
    assert m.ttft_samples == 0
    assert m.waiting_requests == 0
    assert m.data_age_s is not None


def test_no_series_is_missing_data_with_a_hint(source: PrometheusSource) -> None:
    """An empty answer (a service whose engines are not scraped) is no data, never zero."""
    m = source.observe("nobody", "small", "unified", WINDOW, namespace="ml")
    assert m.problem is DataProblem.MISSING
    assert m.waiting_requests is None
    assert m.kv_cache_usage_frac is None
    assert 'fleetpilot_dev_service="nobody"' in m.detail
    assert "are the engines scraped" in m.detail


def test_promql_error_is_no_data_and_no_scale_down(driven: Fleet) -> None:
    """A query Prometheus refuses (here a broken metric name) is "query error", and the
    policy holds on it."""
    broken = MetricNames(waiting='vllm:num_requests_waiting{"')
    with PrometheusSource(driven.prometheus.url, metrics=broken) as src:
        m = src.observe("reader", "small", "unified", WINDOW, namespace="ml")
    assert m.problem is DataProblem.QUERY_ERROR
    assert m.detail.startswith("prometheus answered 400: bad_data:")
    decision = decide(Observation(5, 5, m), Policy("unified", 1, 10), History(), 0.0)
    assert decision.replicas == 5
    assert decision.data_problem is DataProblem.QUERY_ERROR


def test_prometheus_down_is_no_data_at_once() -> None:
    """Nothing listening: every value None, and the reason says so."""
    port = free_ports(1)[0]
    with PrometheusSource(f"http://127.0.0.1:{port}", timeout_s=2.0) as src:
        m = src.observe("reader", "small", "unified", WINDOW, namespace="ml")
    assert m.problem is DataProblem.UNREACHABLE
    assert m.detail == (
        f"cannot connect to prometheus at http://127.0.0.1:{port} (Connection refused)"
    )
    assert m == Metrics(problem=m.problem, detail=m.detail)


def _listening() -> socket.socket:
    """A server socket that never accepts by itself: connections wait in its backlog (64, more
    than one observation's queries), where the test can count them."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.setblocking(False)
    return listener


def _accepted(listener: socket.socket) -> list[socket.socket]:
    """Every connection waiting in ``listener``'s backlog now (those closed by their client
    since included)."""
    taken: list[socket.socket] = []
    while True:
        try:
            taken.append(listener.accept()[0])
        except BlockingIOError:
            return taken


def _planned(source: PrometheusSource) -> int:
    """How many queries one observation of the reader's small tier sends."""
    sel = selector(source.labels, "reader", "small", "unified", "ml")
    router = router_queries(source.labels, "reader", "small", "unified", "ml", WINDOW)
    return len(queries(sel, WINDOW, source.metric_names)) + len(router)


def test_a_hanging_prometheus_costs_one_timeout() -> None:
    """A server that accepts and never answers: every query asks once and times out, none is
    retried (the next tick is the retry)."""
    with _listening() as listener:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with PrometheusSource(url, timeout_s=0.5) as src:
            m = src.observe("reader", "small", "unified", WINDOW, namespace="ml")
            planned = _planned(src)
        asked = _accepted(listener)
        for conn in asked:
            conn.close()
    assert len(asked) == planned
    assert m.problem is DataProblem.UNREACHABLE
    assert m.detail == f"prometheus at {url} did not answer within 0.5s"


def test_the_queries_of_one_observation_wait_together() -> None:
    """All queries of one observation are in flight at once, so a hanging Prometheus costs the
    tick one timeout, not one per query: with a timeout far longer than the test, every query's
    connection is open at the same time before any is answered."""
    with _listening() as listener, ThreadPoolExecutor(1) as caller:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        held: list[socket.socket] = []
        with PrometheusSource(url, timeout_s=300.0) as src:
            planned = _planned(src)
            observed = caller.submit(
                src.observe, "reader", "small", "unified", WINDOW, namespace="ml"
            )

            def open_now() -> int:
                held.extend(_accepted(listener))
                return len(held)

            eventually("every query waiting at once", open_now, 60, until=lambda n: n >= planned)
            assert not observed.done()
            for conn in held:
                conn.close()  # unanswered: each query fails at once, not after 300 s
            m = observed.result(timeout=60)
    assert len(held) == planned
    assert m.problem is DataProblem.UNREACHABLE


def test_selector_escapes_and_label_names_are_configurable() -> None:
    """A service name with a quote cannot break out of its label matcher, and another
    relabeling (other label names, no namespace label) is one LabelNames away."""
    labels = LabelNames(service="svc", tier="t", role="r", namespace=None)
    assert selector(labels, 'a"b', "small", "unified", "ml") == (
        '{svc="a\\"b",t="small",r="unified"}'
    )
    assert selector(LabelNames(), "chat", "small", "decode", "ml") == (
        '{fleetpilot_dev_service="chat",fleetpilot_dev_tier="small",'
        'fleetpilot_dev_role="decode",namespace="ml"}'
    )


def test_promql_text() -> None:
    """The documented queries, exactly (readers of dashboards copy them)."""
    q = queries("{S}", timedelta(minutes=1), MetricNames(escaped_too=False))
    assert q["ttft_p95_s"] == (
        "histogram_quantile(0.95, sum by (le) "
        "(rate(vllm:time_to_first_token_seconds_bucket{S}[60s])))"
    )
    assert q["kv_cache_usage_frac"] == "avg(vllm:kv_cache_usage_perc{S})"
    assert q["prefix_hit_rate_frac"] == (
        "(sum(rate(vllm:prefix_cache_hits_total{S}[60s])) + "
        "(sum(rate(vllm:external_prefix_cache_hits_total{S}[60s])) or vector(0))) / "
        "sum(rate(vllm:prefix_cache_queries_total{S}[60s]))"
    )
    both = queries("{S}", timedelta(seconds=1.5))
    assert both["waiting_requests"] == (
        "sum(vllm:num_requests_waiting{S} or vllm_num_requests_waiting{S})"
    )
    assert promql_duration(timedelta(seconds=1.5)) == "1500ms"


def test_combine_never_decides_on_a_partial_picture() -> None:
    """One failed query marks the whole observation, and its values are dropped."""
    results = {
        "waiting_requests": QueryResult(3.0),
        "data_age_s": QueryResult(1.0),
        "kv_cache_usage_frac": QueryResult(None, DataProblem.QUERY_ERROR, "boom"),
    }
    m = combine(results, "probe")
    assert m == Metrics(problem=DataProblem.QUERY_ERROR, detail="boom")


def test_a_role_without_engines_reports_the_demand_the_router_holds() -> None:
    """No engine series (a role at zero): the router's held requests and spill rate stand in
    for waiting and arrivals, still flagged missing (never a reason to scale down)."""
    results = {
        "waiting_requests": QueryResult(None, None, "no series"),
        "data_age_s": QueryResult(None, None, "no series"),
        "router_pending": QueryResult(2.0),
        "router_spilled_rps": QueryResult(0.5),
    }
    m = combine(results, "probe")
    assert m.problem is DataProblem.MISSING
    assert (m.waiting_requests, m.arrival_rate_rps) == (2.0, 0.5)
    # With engines reporting, the requests the router holds (its fair queue) add to the
    # engines' waiting ones; its spill rate is not their arrivals; no notes.
    results["data_age_s"] = QueryResult(0.5)
    results["waiting_requests"] = QueryResult(1.0)
    m = combine(results, "probe")
    assert (m.problem, m.waiting_requests, m.arrival_rate_rps) == (None, 3.0, None)
    assert "router" not in m.detail
    results["router_pending"] = QueryResult(0.0)
    assert combine(results, "probe").waiting_requests == 1.0


def test_router_demand_promql() -> None:
    """The router's held requests are selected by its own tier and role labels and its
    spillovers by ``from_tier``: the demand of one role at zero, not of the whole service."""
    planned = router_queries(LabelNames(), "chat", "small", "unified", "ml", timedelta(seconds=30))
    assert planned == {
        "router_pending": (
            'sum(fleetpilot_router_pending_requests{fleetpilot_dev_service="chat",'
            'tier="small",role="unified",namespace="ml"})'
        ),
        "router_spilled_rps": (
            'sum(rate(fleetpilot_router_spillovers_total{fleetpilot_dev_service="chat",'
            'from_tier="small",namespace="ml"}[30s]))'
        ),
    }


def test_sources_follow_the_service_prometheus_url() -> None:
    """spec.monitoring.prometheusUrl wins over the operator's default; one source per URL."""
    sources = PrometheusSources("http://prometheus.monitoring:9090")
    try:
        default = sources.for_url(None)
        own = sources.for_url("http://team-prometheus:9090")
        assert default is not None
        assert own is not None
        assert default.url == "http://prometheus.monitoring:9090"
        assert own.url == "http://team-prometheus:9090"
        assert sources.for_url(None) is default
    finally:
        sources.close()
    assert PrometheusSources(None).for_url(None) is None
