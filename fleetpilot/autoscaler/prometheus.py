"""Reading what the policy needs from Prometheus, one role of one tier at a time.

A thin reader: it builds PromQL, runs the queries concurrently with a deadline, and turns every
failure into "no value" with a reason (never an exception), because one Prometheus hiccup must
not stop the scaling of every other service. It decides nothing; see ``policy``.

Engine series are selected by the pod labels the planner sets (``fleetpilot.dev/service``,
``fleetpilot.dev/tier``, ``fleetpilot.dev/role``) as they appear after Prometheus' relabeling.
A Kubernetes scrape config turns pod labels into ``__meta_kubernetes_pod_label_<name>`` with
every character outside ``[a-zA-Z0-9_]`` replaced by ``_``; the usual ``labelmap`` rule (and the
Prometheus Operator's ``podTargetLabels``) then keeps them as ``fleetpilot_dev_service`` and so
on, and the namespace as ``namespace``. Another naming is one :class:`LabelNames` away::

    - job_name: fleetpilot-engines
      kubernetes_sd_configs: [{role: pod}]
      relabel_configs:
        - action: labelmap
          regex: __meta_kubernetes_pod_label_(fleetpilot_dev_.+)
        - source_labels: [__meta_kubernetes_namespace]
          target_label: namespace

The PromQL, with ``S`` the label selector and ``W`` the window (``autoscaling.window``):

- TTFT p95: ``histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{S}[W])))``
- TTFT samples: ``sum(increase(vllm:time_to_first_token_seconds_count{S}[W]))``
- TPOT p95 and samples: the same over ``vllm:inter_token_latency_seconds``
- KV-cache usage: ``avg(vllm:kv_cache_usage_perc{S})``
- waiting / running: ``sum(vllm:num_requests_waiting{S})`` / ``sum(vllm:num_requests_running{S})``
- reporting engines: ``count(vllm:num_requests_waiting{S})``
- arrival rate: ``sum(rate(vllm:request_success_total{S}[W]))``
- prefix hit rate, both KV tiers: ``(sum(rate(vllm:prefix_cache_hits_total{S}[W])) +
  (sum(rate(vllm:external_prefix_cache_hits_total{S}[W])) or vector(0))) /
  sum(rate(vllm:prefix_cache_queries_total{S}[W]))``: the device's hits, and what the KV
  connector (the host tier of ``engine.kvOffload``) supplied past them; ``or vector(0)`` for
  engines that export no connector counter

The KV-cache usage stays the device's alone: a running sequence's KV must be in the device
pool, so that pool's room is what admits more sequences; the host tier only caches prefixes
(and makes a miss cheaper, which the hit rate shows).
- data age: ``time() - max(timestamp(vllm:num_requests_waiting{S}))``

Demand the router sees for a role with no engines (scale from zero), with ``R`` the router's
selector (service and namespace labels, and the router metric's own ``tier`` and ``role``):

- held requests: ``sum(fleetpilot_router_pending_requests{R})``
- requests spilled elsewhere for want of a replica: ``sum(rate(fleetpilot_router_spillovers_total
  {service labels, from_tier="T"}[W]))``

They stand in for the waiting requests and the arrival rate when the role has no engine
series at all; with engines, the held requests (the router's fair queue, ``routing.flow``) add
to their waiting requests.

Inside each aggregation the series are read under both names, ``rate(vllm:x{S}[W]) or
rate(vllm_x{S}[W])``: see :func:`escaped_name` for why an engine's series may be stored with an
underscore for the colon.
"""  # noqa: E501

from __future__ import annotations

import codecs
import json
import logging
import math
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from datetime import timedelta
from types import TracebackType
from typing import Any, Protocol, Self, cast

import requests
import urllib3
from prometheus_api_client.exceptions import PrometheusApiClientException
from prometheus_api_client.prometheus_connect import PrometheusConnect
from urllib3.util.retry import Retry

from fleetpilot.autoscaler.model import DataProblem, Metrics

log = logging.getLogger(__name__)

# Five seconds: well inside the 15 s default interval, so a hung Prometheus costs one tick at
# most, and far above a healthy instant query (milliseconds).
DEFAULT_TIMEOUT_S = 5.0
QUANTILE = 0.95
ROUTER_PENDING_METRIC = "fleetpilot_router_pending_requests"
ROUTER_SPILLOVERS_METRIC = "fleetpilot_router_spillovers_total"
# Result keys of the router's queries (not Metrics fields: see combine).
ROUTER_PENDING = "router_pending"
ROUTER_SPILLED = "router_spilled_rps"


class MetricsSource(Protocol):
    """Where observations come from: Prometheus here, engines' /metrics for the local runtime.

    ``observe`` must not raise for data problems: it returns :class:`Metrics` with the values
    it could not read set to None and ``problem``/``detail`` saying why. A source may report
    demand seen upstream of the engines (``waiting_requests``, ``arrival_rate_rps``) for a role
    at zero replicas, which is what lets the policy scale it from zero.
    """

    def observe(
        self, service: str, tier: str, role: str, window: timedelta, *, namespace: str | None
    ) -> Metrics: ...


@dataclass(frozen=True)
class LabelNames:
    """Prometheus label names that carry the engine pods' fleetpilot labels.

    The defaults are what relabeling makes of ``fleetpilot.dev/service`` (and tier, role): see
    the module docstring. ``namespace=None`` drops the namespace from the selector (a Prometheus
    that scrapes one namespace only).
    """

    service: str = "fleetpilot_dev_service"
    tier: str = "fleetpilot_dev_tier"
    role: str = "fleetpilot_dev_role"
    namespace: str | None = "namespace"


@dataclass(frozen=True)
class MetricNames:
    """The vLLM metric names read (vLLM >= 0.10 names; the reference engine exports the same)."""

    ttft_histogram: str = "vllm:time_to_first_token_seconds"
    tpot_histogram: str = "vllm:inter_token_latency_seconds"
    kv_cache_usage: str = "vllm:kv_cache_usage_perc"
    waiting: str = "vllm:num_requests_waiting"
    running: str = "vllm:num_requests_running"
    success: str = "vllm:request_success_total"
    prefix_queries: str = "vllm:prefix_cache_queries_total"
    prefix_hits: str = "vllm:prefix_cache_hits_total"
    # Hits the KV connector supplied past the device's (the host tier, engine.kvOffload).
    external_prefix_hits: str = "vllm:external_prefix_cache_hits_total"
    # Also read the names with ':' written as '_' (see escaped_name).
    escaped_too: bool = True


def selector(labels: LabelNames, service: str, tier: str, role: str, namespace: str | None) -> str:
    """``{fleetpilot_dev_service="chat",...}``, values escaped as PromQL strings."""
    pairs = [(labels.service, service), (labels.tier, tier), (labels.role, role)]
    if labels.namespace is not None and namespace is not None:
        pairs.append((labels.namespace, namespace))
    return "{" + ",".join(f"{name}={json.dumps(value)}" for name, value in pairs) + "}"


def router_selector(labels: LabelNames, service: str, namespace: str | None, **own: str) -> str:
    """The router's series of one service, with the router metric's own labels (``tier``...)."""
    pairs = [(labels.service, service), *own.items()]
    if labels.namespace is not None and namespace is not None:
        pairs.append((labels.namespace, namespace))
    return "{" + ",".join(f"{name}={json.dumps(value)}" for name, value in pairs) + "}"


def router_queries(
    labels: LabelNames,
    service: str,
    tier: str,
    role: str,
    namespace: str | None,
    window: timedelta,
) -> dict[str, str]:
    """PromQL for the demand the router holds or spills for one role. Purely computational."""
    pending = router_selector(labels, service, namespace, tier=tier, role=role)
    spilled = router_selector(labels, service, namespace, from_tier=tier)
    w = promql_duration(window)
    return {
        ROUTER_PENDING: f"sum({ROUTER_PENDING_METRIC}{pending})",
        ROUTER_SPILLED: f"sum(rate({ROUTER_SPILLOVERS_METRIC}{spilled}[{w}]))",
    }


def promql_duration(window: timedelta) -> str:
    """A PromQL range: whole seconds as ``60s``, otherwise milliseconds (``1500ms``)."""
    millis = max(1, round(window.total_seconds() * 1000))
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def escaped_name(name: str) -> str:
    """``vllm:num_requests_waiting`` -> ``vllm_num_requests_waiting``.

    prometheus_client (0.2x, client_python issue #1177) writes colons as underscores in sample
    names when a scraper negotiates OpenMetrics without ``escaping=allow-utf-8``, as Prometheus
    2.x does; so the same vLLM engine is stored under either name, depending on the versions.
    """
    return name.replace(":", "_")


def queries(sel: str, window: timedelta, names: MetricNames | None = None) -> dict[str, str]:
    """The PromQL for each :class:`Metrics` field, for one role. Purely computational."""
    n = names or MetricNames()
    w = promql_duration(window)

    def series(metric: str, inner: Callable[[str], str]) -> str:
        # Per engine series, under either name: ``or`` matches label sets without the metric
        # name, so an engine stored under both names counts once, and a fleet mixing
        # exposition formats (a rolling upgrade) counts every engine.
        first = inner(metric)
        if not n.escaped_too or escaped_name(metric) == metric:
            return first
        return f"{first} or {inner(escaped_name(metric))}"

    def quantile(histogram: str) -> str:
        buckets = series(f"{histogram}_bucket", lambda h: f"rate({h}{sel}[{w}])")
        return f"histogram_quantile({QUANTILE}, sum by (le) ({buckets}))"

    def samples(histogram: str) -> str:
        return f"sum({series(f'{histogram}_count', lambda h: f'increase({h}{sel}[{w}])')})"

    def rate(counter: str) -> str:
        return f"sum({series(counter, lambda c: f'rate({c}{sel}[{w}])')})"

    def gauge(aggregation: str, metric: str) -> str:
        return f"{aggregation}({series(metric, lambda g: f'{g}{sel}')})"

    return {
        "ttft_p95_s": quantile(n.ttft_histogram),
        "ttft_samples": samples(n.ttft_histogram),
        "tpot_p95_s": quantile(n.tpot_histogram),
        "tpot_samples": samples(n.tpot_histogram),
        "kv_cache_usage_frac": gauge("avg", n.kv_cache_usage),
        "waiting_requests": gauge("sum", n.waiting),
        "running_requests": gauge("sum", n.running),
        "reporting_engines": gauge("count", n.waiting),
        "arrival_rate_rps": rate(n.success),
        "prefix_hit_rate_frac": (
            f"({rate(n.prefix_hits)} + ({rate(n.external_prefix_hits)} or vector(0))) / "
            f"{rate(n.prefix_queries)}"
        ),
        "data_age_s": f"time() - max({series(n.waiting, lambda g: f'timestamp({g}{sel})')})",
    }


@dataclass(frozen=True)
class QueryResult:
    """One query's value, or why there is none."""

    value: float | None
    problem: DataProblem | None = None
    detail: str = ""


_STATUS_RE = re.compile(r"HTTP Status Code (\d+) \((.*)\)\s*$", re.DOTALL)


def _unrepr(text: str) -> str:
    """The text of a ``repr()`` of bytes or str (``b'...'``), without ``ast``: CPython 3.11's
    parser keeps its recursion depth in state shared by threads, so parsing here beside another
    thread that parses can fail with SystemError (python/cpython#106905)."""
    if text[:2] in ("b'", 'b"'):
        text = text[1:]
    if len(text) < 2 or text[0] not in "'\"" or text[-1] != text[0]:
        raise ValueError("not a repr")
    raw, _ = codecs.escape_decode(text[1:-1].encode("latin-1", "backslashreplace"))
    return bytes(raw).decode("utf-8", "replace")


def _api_error(exc: PrometheusApiClientException) -> QueryResult:
    """Classify a non-200 answer: 5xx means Prometheus is in trouble, 4xx that the query is."""
    text = str(exc)
    match = _STATUS_RE.search(text)
    if match is None:
        return QueryResult(None, DataProblem.QUERY_ERROR, text[:300])
    status = int(match.group(1))
    message = match.group(2)
    try:  # the client puts repr(response.content) in its message; Prometheus' JSON is inside
        decoded = json.loads(_unrepr(message))
        message = f"{decoded.get('errorType', 'error')}: {decoded.get('error', '')}"
    except (ValueError, AttributeError, TypeError):
        message = message[:300]
    problem = DataProblem.UNREACHABLE if status >= 500 else DataProblem.QUERY_ERROR
    return QueryResult(None, problem, f"prometheus answered {status}: {message}")


def _value(result: Any, field_name: str) -> QueryResult:
    """The single value of an aggregated instant vector (or scalar) answer."""
    if isinstance(result, list):
        if not result:
            return QueryResult(None, None, f"{field_name}: no series")
        sample = result[0].get("value") if isinstance(result[0], dict) else None
    else:
        sample = result  # a scalar answer: [time, "value"]
    try:
        value = float(sample[1])  # type: ignore[index]
    except (TypeError, ValueError, IndexError):
        return QueryResult(None, DataProblem.QUERY_ERROR, f"{field_name}: unexpected answer")
    if math.isnan(value):
        # histogram_quantile of no observations, or 0/0: nothing was measured.
        return QueryResult(None, None, f"{field_name}: no observations in the window")
    return QueryResult(value)


class PrometheusSource:
    """:class:`MetricsSource` over the Prometheus HTTP API (prometheus-api-client).

    Each query has ``timeout_s``; all queries of one ``observe`` run concurrently and share
    that same deadline, so one call costs at most about ``timeout_s`` however Prometheus
    fails. Connection errors are not retried: the next tick is the retry.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        labels: LabelNames | None = None,
        metrics: MetricNames | None = None,
        headers: dict[str, str] | None = None,
        max_workers: int = 16,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.labels = labels or LabelNames()
        self.metric_names = metrics or MetricNames()
        self._headers = headers
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="promql")
        # requests.Session is not documented thread-safe: one client per worker thread.
        self._local = threading.local()
        self._clients: list[PrometheusConnect] = []
        self._clients_lock = threading.Lock()
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._clients_lock:
            for client in self._clients:
                client.close()
            self._clients.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _client(self) -> PrometheusConnect:
        client: PrometheusConnect | None = getattr(self._local, "client", None)
        if client is None:
            client = PrometheusConnect(
                url=self.url,
                headers=dict(self._headers or {}),
                # No retries: the next tick is the retry. (urllib3 then reports every error,
                # read timeouts included, as MaxRetryError; see _request_error.)
                retry=Retry(total=0, connect=0, read=0, redirect=0, status=0),
                # Annotated int by the client, handed to requests, which takes float seconds.
                timeout=cast(int, self.timeout_s),
            )
            self._local.client = client
            with self._clients_lock:
                self._clients.append(client)
        return client

    # -- queries --------------------------------------------------------------------------
    def query(self, promql: str, field_name: str = "value") -> QueryResult:
        """Run one instant query; every failure becomes a :class:`QueryResult` without value."""
        try:
            result = self._client().custom_query(promql)
        except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
            return QueryResult(None, DataProblem.UNREACHABLE, self._request_error(exc))
        except PrometheusApiClientException as exc:
            return _api_error(exc)
        except ValueError as exc:  # a body that is not JSON: not Prometheus, or a proxy page
            return QueryResult(None, DataProblem.QUERY_ERROR, f"unexpected answer: {exc}")
        except Exception as exc:  # whatever else: still "no data", never a crash of the tick
            log.warning("prometheus query failed unexpectedly", exc_info=True)
            return QueryResult(None, DataProblem.UNREACHABLE, f"prometheus at {self.url}: {exc!r}")
        return _value(result, field_name)

    def _request_error(self, exc: BaseException) -> str:
        """Timeouts say so; connection failures name their root cause ("Connection refused")."""
        reason: BaseException = exc
        if isinstance(exc, requests.RequestException) and exc.args:
            reason = exc.args[0]
        if isinstance(reason, urllib3.exceptions.MaxRetryError) and reason.reason is not None:
            reason = reason.reason
        errors = urllib3.exceptions
        # NewConnectionError subclasses ConnectTimeoutError in urllib3 2: test it first.
        if isinstance(reason, errors.NewConnectionError):
            return f"cannot connect to prometheus at {self.url} ({_root_cause(reason)})"
        if isinstance(reason, errors.ReadTimeoutError) or isinstance(exc, requests.ReadTimeout):
            return f"prometheus at {self.url} did not answer within {self.timeout_s:g}s"
        if isinstance(reason, errors.ConnectTimeoutError) or isinstance(exc, requests.Timeout):
            return f"prometheus at {self.url} took no connection within {self.timeout_s:g}s"
        return f"cannot connect to prometheus at {self.url} ({_root_cause(reason)})"

    def observe(
        self,
        service: str,
        tier: str,
        role: str,
        window: timedelta,
        *,
        namespace: str | None = None,
    ) -> Metrics:
        sel = selector(self.labels, service, tier, role, namespace)
        planned = queries(sel, window, self.metric_names)
        planned.update(router_queries(self.labels, service, tier, role, namespace, window))
        results = self._run_all(planned)
        return combine(results, f"{self.metric_names.waiting}{sel}")

    def _run_all(self, planned: dict[str, str]) -> dict[str, QueryResult]:
        if self._closed:
            return dict.fromkeys(
                planned, QueryResult(None, DataProblem.UNREACHABLE, "metrics source is closed")
            )
        futures: dict[str, Future[QueryResult]] = {
            name: self._pool.submit(self.query, promql, name) for name, promql in planned.items()
        }
        # The per-request timeout bounds each query; this bounds the whole set, queueing
        # included, should the pool be busy with other roles.
        wait(futures.values(), timeout=self.timeout_s + 1.0)
        results: dict[str, QueryResult] = {}
        for name, future in futures.items():
            if future.done() and not future.cancelled():
                results[name] = future.result()
            else:
                future.cancel()
                results[name] = QueryResult(
                    None,
                    DataProblem.UNREACHABLE,
                    f"prometheus at {self.url} did not answer within {self.timeout_s:g}s",
                )
        return results


def _root_cause(exc: BaseException) -> str:
    """The innermost reason of a wrapped connection error ("Connection refused")."""
    text = str(exc)
    match = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    return match.group(1) if match else text[:200]


_INT_FIELDS = {"reporting_engines"}


def combine(results: dict[str, QueryResult], probe: str) -> Metrics:
    """Fold per-query results into :class:`Metrics`. Purely computational.

    A failed query anywhere marks the whole observation (unreachable first, then query
    errors): values read around a failure are not a consistent picture. No engine series at all
    (no data age) is "missing".
    """
    values: dict[str, Any] = {}
    known = {f.name for f in fields(Metrics)}
    for name, result in results.items():
        if name in known and result.value is not None:
            values[name] = int(result.value) if name in _INT_FIELDS else result.value
    problem: DataProblem | None = None
    detail = ""
    for kind in (DataProblem.UNREACHABLE, DataProblem.QUERY_ERROR):
        failed = [r for r in results.values() if r.problem is kind]
        if failed:
            problem, detail = kind, failed[0].detail
            break
    if problem is None and results.get("data_age_s", QueryResult(None)).value is None:
        problem = DataProblem.MISSING
        detail = f"no series {probe}: are the engines scraped, with these labels?"
    if problem is None:
        notes = [
            r.detail
            for name, r in results.items()
            if name in known and r.value is None and r.detail
        ]
        detail = "; ".join(notes)
    if problem is None:
        # Requests the router holds for this role (its fair queue while every replica is
        # saturated: routing.flow) wait as much as those in the engines' queues.
        held = results.get(ROUTER_PENDING, QueryResult(None)).value
        if held:
            values["waiting_requests"] = values.get("waiting_requests", 0.0) + held
    if problem is not None:
        values = {}  # do not decide on a partial picture
    if problem is DataProblem.MISSING:
        # No engine at all: the demand upstream of the engines is what there is to see (the
        # policy reads it only for a role at zero replicas).
        pending = results.get(ROUTER_PENDING, QueryResult(None)).value
        spilled = results.get(ROUTER_SPILLED, QueryResult(None)).value
        values = {"waiting_requests": pending, "arrival_rate_rps": spilled}
    return Metrics(**values, problem=problem, detail=detail)


@dataclass
class PrometheusSources:
    """One :class:`PrometheusSource` per Prometheus URL, for services that name their own
    (``spec.monitoring.prometheusUrl``) next to the operator's default."""

    default_url: str | None
    timeout_s: float = DEFAULT_TIMEOUT_S
    labels: LabelNames = field(default_factory=LabelNames)
    _sources: dict[str, PrometheusSource] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def for_url(self, url: str | None) -> PrometheusSource | None:
        """The source for ``url`` (else the default), or None when neither is set."""
        chosen = url or self.default_url
        if chosen is None:
            return None
        with self._lock:
            if chosen not in self._sources:
                self._sources[chosen] = PrometheusSource(
                    chosen, timeout_s=self.timeout_s, labels=self.labels
                )
            return self._sources[chosen]

    def close(self) -> None:
        with self._lock:
            for source in self._sources.values():
                source.close()
            self._sources.clear()


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LabelNames",
    "MetricNames",
    "MetricsSource",
    "PrometheusSource",
    "PrometheusSources",
    "QueryResult",
    "combine",
    "escaped_name",
    "promql_duration",
    "queries",
    "selector",
]
