"""Fake vLLM engines for the autoscaler tests: vLLM's metric names, labels and buckets.

An :class:`Engine` is a small HTTP exporter (prometheus_client, in a thread, on a free loopback
port). A driver thread calls :meth:`Engine.tick` every 100 ms, which applies the engine's
:class:`Load`, so rates and percentiles are steady when the reader looks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder, generate_latest

from fleetpilot.kube.names import engine_selector
from fleetpilot.runtime.prometheus import PrometheusServer, ScrapeTarget

# vLLM's buckets (vllm/v1/metrics/loggers.py), so interpolation behaves as with real engines.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
DRIVE_PERIOD_S = 0.1


@dataclass
class Load:
    """What an engine sees every 100 ms: latencies observed, requests finished, cache use."""

    ttft_s: tuple[float, ...] = ()
    itl_s: tuple[float, ...] = ()
    successes: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    external_prefix_hits: int = 0  # the KV connector's (host tier); exported only when set


@dataclass(frozen=True)
class EngineKey:
    namespace: str
    service: str
    tier: str
    role: str


class Engine:
    """One fake vLLM engine: its metrics, served over HTTP.

    ``escaped=True`` serves what prometheus_client negotiates with Prometheus 2.x (OpenMetrics
    with colons written as underscores: client_python issue #1177); otherwise the classic text
    format, which keeps the colons (as fleetpilot's reference engine does).
    """

    def __init__(self, key: EngineKey, index: int = 0, *, escaped: bool = False) -> None:
        self.key = key
        self.escaped = escaped
        self.registry = CollectorRegistry()
        labels = {"model_name": "m", "engine": str(index)}
        names = list(labels)

        def gauge(name: str) -> Gauge:
            return Gauge(name, name, names, registry=self.registry)

        def counter(name: str) -> Counter:
            return Counter(name, name, names, registry=self.registry)

        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "ttft",
            names,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "itl",
            names,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.kv = gauge("vllm:kv_cache_usage_perc").labels(**labels)
        self.waiting = gauge("vllm:num_requests_waiting").labels(**labels)
        self.running = gauge("vllm:num_requests_running").labels(**labels)
        self.success = counter("vllm:request_success").labels(**labels)
        self.prefix_queries = counter("vllm:prefix_cache_queries").labels(**labels)
        self.prefix_hits = counter("vllm:prefix_cache_hits").labels(**labels)
        # Created on first use: the other engines export none, as an engine without a KV
        # connector counter (before vLLM 0.11) does.
        self._labels = labels
        self.external_prefix_hits: Counter | None = None
        self.load: Load | None = None
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        # A short poll interval: shutdown() waits for it, once per engine, at the session's end.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def target(self) -> ScrapeTarget:
        k = self.key
        return ScrapeTarget(self.address, engine_selector(k.service, k.tier, k.role), k.namespace)

    def set(self, *, kv: float = 0.0, waiting: float = 0.0, running: float = 0.0) -> None:
        self.kv.set(kv)
        self.waiting.set(waiting)
        self.running.set(running)

    def drive(self, load: Load | None) -> None:
        with self._lock:
            self.load = load

    def tick(self) -> None:
        with self._lock:
            load = self.load
            if load is None:
                return
            # Under the lock a scrape cannot fall between two observations of one batch
            # (exports take the same lock), so every scrape sees whole batches.
            for value in load.ttft_s:
                self.ttft.observe(value)
            for value in load.itl_s:
                self.itl.observe(value)
            self.success.inc(load.successes)
            self.prefix_queries.inc(load.prefix_queries)
            self.prefix_hits.inc(load.prefix_hits)
            if load.external_prefix_hits:
                if self.external_prefix_hits is None:
                    family = Counter(
                        "vllm:external_prefix_cache_hits",
                        "hits",
                        list(self._labels),
                        registry=self.registry,
                    )
                    self.external_prefix_hits = family.labels(**self._labels)
                self.external_prefix_hits.inc(load.external_prefix_hits)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        with self._lock:
            if self.escaped:
                encoder, content_type = choose_encoder(accept)
                return encoder(self.registry), content_type
            return generate_latest(self.registry), "text/plain; version=0.0.4; charset=utf-8"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body, content_type = engine.exposition(self.headers.get("Accept", ""))
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # scrapes every second would flood the test output

        return Handler


@dataclass
class Fleet:
    """Every fake engine of the session, and the Prometheus scraping them."""

    prometheus: PrometheusServer
    engines: dict[EngineKey, list[Engine]] = field(default_factory=dict)

    def of(self, namespace: str, service: str, tier: str, role: str) -> list[Engine]:
        return self.engines[EngineKey(namespace, service, tier, role)]
