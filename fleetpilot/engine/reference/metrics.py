"""Prometheus metrics of the reference engine server, named, labelled and bucketed as vLLM's.

Names, label names (``model_name``, ``engine``) and histogram buckets follow vLLM's
``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``), so dashboards, the autoscaler's
queries and the router's scrapes work against either engine unchanged. Two sources feed them:

* per-request latency histograms, observed from each ``RequestOutput`` as the engine thread
  produces it (thread-safe ``prometheus_client`` histograms);
* engine-wide counters and gauges, read from the latest ``EngineStats`` snapshot at scrape time
  by a custom collector. The engine already keeps cumulative totals, so exposing them as they
  are is exact, where incrementing ``Counter``s by deltas would duplicate that bookkeeping.

Counters are declared without ``_total``: the exposition format appends it, so what a scrape
shows is exactly vLLM's name (``vllm:prompt_tokens_total``). Every server has its own
``CollectorRegistry``: several servers share a process in tests and in the local fleet.

Deviations from vLLM, on purpose: ``vllm:cache_config_info`` carries only the cache-config
labels the reference engine has (vLLM labels it with every ``CacheConfig`` field; the contract
test holds ours to a subset of vLLM's); the ``vllm:spec_decode_*`` counters are
exposed (as 0) even without speculation, so every scrape has the same series; the
``fleetpilot_kv_transfer_*`` series are ours (vLLM's NIXL connector has its own, different ones).
The series of our own are named ``fleetpilot_*``, never ``fleetpilot:*``: a colon in a name is
for recording rules (the ``vllm:`` names are vLLM's own, kept as vLLM writes them).

Host tier (``--kv-offloading-size``): ``vllm:external_prefix_cache_queries`` and ``_hits`` (the
prompt tokens past the device hit, and those the host tier supplied) and
``vllm:prompt_tokens_cached_by_source`` (``device`` and ``host``; vLLM's other sources read 0)
are exported always, as vLLM registers them always; with a host tier, the offloading
connector's ``vllm:kv_offload_*`` too: bytes, seconds and sizes of loads and stores (seconds as
the pacing makes them), store allocation failures and sizes, the tier's
``cpu_cache_usage_perc`` (as vLLM's: the fraction pinned by copies in flight, not how full it
is, which ``fleetpilot_kv_offload_cpu_blocks_used`` says) and ``vllm:kv_offload_config_info``.
vLLM's deprecated ``vllm:kv_offload_total_*`` / ``_size`` (labelled ``transfer_type``) are not.

LoRA: with ``--enable-lora``, ``vllm:lora_requests_info`` as vLLM's: a gauge labelled
``max_lora`` and the comma-joined adapter names of the running and the waiting requests (no
model name), whose value is the time (unix seconds) of the engine state it describes. vLLM
keeps every label set it ever set, each with its last time; this exports the current one only,
which is the series a reader of vLLM's takes (the latest). ``fleetpilot_lora_adapter_loads``
and ``fleetpilot_lora_adapter_activations`` count adapter reads and slot swaps (ours).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Final

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from fleetpilot.engine.reference.engine import EngineStats
from fleetpilot.engine.reference.offload import SizeHistogram
from fleetpilot.engine.reference.request import RequestMetrics

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

LABEL_NAMES: Final = ("model_name", "engine")

# vLLM's buckets, copied from vllm/v1/metrics/loggers.py.
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# Used by vllm:inter_token_latency_seconds and vllm:request_time_per_output_token_seconds.
TOKEN_LATENCY_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISH_REASONS: Final = ("stop", "length", "abort")
# vLLM's CacheHitSource values: where the KV of cached prompt tokens came from.
CACHE_HIT_SOURCES: Final = ("device", "host", "p2p", "disk", "external_unspecified")
# Why a decode server prefilled locally instead of using a P/D hand-off.
KV_FALLBACK_REASONS: Final = ("not_found", "pull_failed", "refused", "unusable")


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets for token counts."""
    buckets: list[float] = []
    for exponent in itertools.count():
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
    raise AssertionError("unreachable")  # pragma: no cover


def distinct_token_times(times: Iterable[float]) -> list[float]:
    """Token timestamps with a speculative step's shared time kept once.

    vLLM observes one inter-token latency per engine step that produced tokens, not one per
    token: a step that emits 3 accepted tokens is one 'token interval', not two of length 0.
    """
    out: list[float] = []
    for t in times:
        if not out or t != out[-1]:
            out.append(t)
    return out


class ServerMetrics:
    """Every series of one server, in its own registry."""

    def __init__(
        self,
        model_name: str,
        *,
        max_model_len: int,
        engine_index: str = "0",
        max_lora: int | None = None,
    ) -> None:
        """``max_lora``: the engine's ``--max-loras`` with LoRA enabled, else None."""
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_lora = max_lora
        self.engine_index = engine_index
        self.registry = CollectorRegistry()
        labels = (model_name, engine_index)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            h = Histogram(
                name, doc, labelnames=LABEL_NAMES, buckets=tuple(buckets), registry=self.registry
            )
            return h.labels(*labels)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self._lock = threading.Lock()
        self._stats: EngineStats | None = None
        self._stats_time = time.time()
        self._cache_info: dict[str, str] | None = None
        self._kv_fallbacks = dict.fromkeys(KV_FALLBACK_REASONS, 0)
        self._kv_pulls = 0
        self.registry.register(_EngineStatsCollector(self))

    # ---- inputs --------------------------------------------------------------------------

    def set_stats(self, stats: EngineStats) -> None:
        """The engine thread's latest snapshot (a fresh object each time: no shared mutation)."""
        self._stats_time = time.time()
        self._stats = stats

    def set_cache_config(self, info: Mapping[str, object]) -> None:
        """Labels of ``vllm:cache_config_info``, known once the KV pool is sized."""
        self._cache_info = {k: str(v) for k, v in info.items()}

    def count_kv_fallback(self, reason: str) -> None:
        if reason not in self._kv_fallbacks:
            raise ValueError(f"unknown KV fallback reason {reason!r}")
        with self._lock:
            self._kv_fallbacks[reason] += 1

    def count_kv_pull(self) -> None:
        with self._lock:
            self._kv_pulls += 1

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(max(ttft_s, 0.0))

    def observe_inter_token(self, latency_s: float) -> None:
        self.itl.observe(max(latency_s, 0.0))

    def observe_finished(self, m: RequestMetrics, *, num_prompt: int, num_output: int) -> None:
        """Per-request histograms of a finished (or aborted) request, as vLLM computes them."""
        if m.finished_time is None:
            return
        self.e2e.observe(max(m.finished_time - m.arrival_time, 0.0))
        self.prompt_tokens.observe(num_prompt)
        self.generation_tokens.observe(num_output)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
        if m.first_token_time is None or m.first_scheduled_time is None:
            return
        last = m.token_times[-1] if m.token_times else m.first_token_time
        self.prefill_time.observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
        decode = max(last - m.first_token_time, 0.0)
        self.decode_time.observe(decode)
        self.inference_time.observe(max(last - m.first_scheduled_time, 0.0))
        # vLLM: decode time over the tokens after the first, and 0 for one-token requests.
        self.tpot.observe(decode / (num_output - 1) if num_output > 1 else 0.0)

    # ---- outputs -------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def kv_fallbacks(self) -> dict[str, int]:
        """Server-side fallbacks plus the engine's unusable imports, by reason."""
        with self._lock:
            counts = dict(self._kv_fallbacks)
        if self._stats is not None:
            counts["unusable"] += self._stats.kv_import_fallbacks_total
        return counts

    def kv_pulls(self) -> int:
        with self._lock:
            return self._kv_pulls

    def cache_info(self) -> dict[str, str] | None:
        return self._cache_info

    def stats(self) -> EngineStats | None:
        return self._stats

    def stats_time(self) -> float:
        """When the latest snapshot was taken (unix seconds)."""
        return self._stats_time


class _EngineStatsCollector(Collector):
    """Counters and gauges from the engine's latest ``EngineStats`` snapshot."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterable[Metric]:
        m = self._m
        labels = [m.model_name, m.engine_index]
        # Before the engine is built every series reads 0, so scrapes see the same names.
        s = m.stats() or EngineStats()

        gauge = functools.partial(_gauge, labels)
        counter = functools.partial(_counter, labels)

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.num_requests_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.num_requests_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_cache_usage_perc,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries_total,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits_total,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.num_preemptions_total,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            s.generation_tokens_total,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*LABEL_NAMES, "finished_reason"],
        )
        by_reason = {**dict.fromkeys(FINISH_REASONS, 0), **s.request_success_total}
        for reason, count in sorted(by_reason.items()):
            success.add_metric([*labels, reason], count)
        yield success
        yield counter(
            "vllm:spec_decode_num_drafts",
            "Number of spec decoding drafts.",
            s.spec_decode_num_drafts_total,
        )
        yield counter(
            "vllm:spec_decode_num_draft_tokens",
            "Number of draft tokens.",
            s.spec_decode_num_draft_tokens_total,
        )
        yield counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Number of accepted tokens.",
            s.spec_decode_num_accepted_tokens_total,
        )
        yield counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.",
            s.external_prefix_cache_queries_total,
        )
        yield counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.",
            s.external_prefix_cache_hits_total,
        )
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            labels=[*LABEL_NAMES, "source"],
        )
        cached = {"device": s.prefix_cache_hits_total, "host": s.external_prefix_cache_hits_total}
        for source in CACHE_HIT_SOURCES:
            by_source.add_metric([*labels, source], cached.get(source, 0))
        yield by_source
        if s.kv_offload_num_blocks:
            yield from _kv_offload_families(s, labels, m.max_model_len)
        info = m.cache_info()
        if info is not None:
            # An info-style gauge fixed at 1, as vLLM emulates Info (multiprocess-safe),
            # labelled with the engine and (some of) the cache config, no model name.
            names = ["engine", *sorted(info)]
            g = GaugeMetricFamily(
                "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=names
            )
            g.add_metric([m.engine_index, *(info[k] for k in sorted(info))], 1)
            yield g
        fallbacks = CounterMetricFamily(
            "fleetpilot_kv_transfer_fallbacks",
            "P/D decode requests that prefilled locally instead of using the remote KV, by reason.",
            labels=[*LABEL_NAMES, "reason"],
        )
        for reason, count in sorted(m.kv_fallbacks().items()):
            fallbacks.add_metric([*labels, reason], count)
        yield fallbacks
        yield counter(
            "fleetpilot_kv_transfer_pulls",
            "Successful KV pulls from a prefill server (P/D decode side).",
            m.kv_pulls(),
        )
        yield counter(
            "fleetpilot_kv_transfer_imported_tokens",
            "Prompt tokens whose KV was imported instead of computed (P/D decode side).",
            s.kv_imported_tokens_total,
        )
        yield counter(
            "fleetpilot_kv_transfer_exported_blocks",
            "KV blocks exported to decode servers (P/D prefill side).",
            s.kv_exported_blocks_total,
        )
        yield counter(
            "fleetpilot_kv_pins_evicted",
            "Pinned P/D prompt KV dropped before its TTL because the pool was full.",
            s.kv_pins_evicted_total,
        )
        yield counter(
            "fleetpilot_lora_adapter_loads",
            "LoRA adapters read from their folders: first loads and reloads after eviction.",
            s.lora_loads_total,
        )
        yield counter(
            "fleetpilot_lora_adapter_activations",
            "LoRA adapters swapped into an active slot (a host-to-device copy on a GPU).",
            s.lora_activations_total,
        )
        if m.max_lora is not None:
            g = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            g.add_metric(
                [
                    str(m.max_lora),
                    ",".join(s.waiting_lora_adapters),
                    ",".join(s.running_lora_adapters),
                ],
                m.stats_time(),
            )
            yield g
        yield counter(
            "fleetpilot_engine_forward_passes",
            "Target-model forward passes (one per engine step that ran the model).",
            s.forward_passes_total,
        )


def _gauge(labels: list[str], name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=LABEL_NAMES)
    g.add_metric(labels, value)
    return g


def _counter(labels: list[str], name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=LABEL_NAMES)
    c.add_metric(labels, value)
    return c


def _histogram(name: str, doc: str, labels: list[str], h: SizeHistogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=LABEL_NAMES)
    # Bounds written as prometheus_client writes a Histogram's ("1e+06", "4.0").
    bounds = [str(floatToGoString(b)) for b in h.bounds]  # type: ignore[no-untyped-call]
    buckets = [(b, float(c)) for b, c in zip(bounds, h.counts, strict=True)]
    family.add_metric(labels, [*buckets, ("+Inf", float(h.count))], h.sum)
    return family


def _kv_offload_families(s: EngineStats, labels: list[str], max_model_len: int) -> Iterable[Metric]:
    """The offloading connector's series (offloading/metrics.py, cpu/spec.py), for one tier."""

    gauge = functools.partial(_gauge, labels)
    counter = functools.partial(_counter, labels)

    yield counter(
        "vllm:kv_offload_load_bytes",
        "Total bytes loaded from offload storage to GPU.",
        s.kv_offload_load_bytes_total,
    )
    yield counter(
        "vllm:kv_offload_load_time",
        "Total load time from offload storage to GPU, in seconds.",
        s.kv_offload_load_time_seconds_total,
    )
    yield _histogram(
        "vllm:kv_offload_load_size",
        "Histogram of KV offload load operation size, in bytes.",
        labels,
        s.kv_offload_load_size,
    )
    yield counter(
        "vllm:kv_offload_store_bytes",
        "Total bytes stored from GPU to offload storage.",
        s.kv_offload_store_bytes_total,
    )
    yield counter(
        "vllm:kv_offload_store_time",
        "Total store time from GPU to offload storage, in seconds.",
        s.kv_offload_store_time_seconds_total,
    )
    yield _histogram(
        "vllm:kv_offload_store_size",
        "Histogram of KV offload store operation size, in bytes.",
        labels,
        s.kv_offload_store_size,
    )
    yield counter(
        "vllm:kv_offload_allocation_failure",
        "Number of KV offload store allocation attempts that failed.",
        s.kv_offload_allocation_failures_total,
    )
    if s.kv_offload_allocation_size is not None:
        yield _histogram(
            "vllm:kv_offload_cpu_allocation_size",
            "Histogram of the number of CPU chunks requested by each KV offload "
            "prepare_store call.",
            labels,
            s.kv_offload_allocation_size,
        )
    yield gauge(
        "vllm:kv_offload_cpu_cache_usage_perc",
        "Fraction of CPU KV-cache space currently pinned by active transfers (0.0 = idle, "
        "1.0 = saturated).",
        s.kv_offload_cpu_cache_usage_perc,
    )
    yield gauge(
        "vllm:kv_offload_cpu_cache_write_usage_perc",
        "Fraction of CPU KV-cache space currently pinned by in-flight stores that have not "
        "yet completed (0.0 = idle, 1.0 = saturated).",
        s.kv_offload_cpu_cache_write_usage_perc,
    )
    yield gauge(
        "vllm:kv_offload_cpu_cache_read_usage_perc",
        "Fraction of CPU KV-cache space currently pinned by in-flight loads that have not "
        "yet completed (0.0 = idle, 1.0 = saturated).",
        s.kv_offload_cpu_cache_read_usage_perc,
    )
    # vLLM's CPUOffloadingInfo, one series: its fields are the labels.
    info = {
        "cpu_num_chunks": s.kv_offload_num_blocks,
        "cpu_blocks_per_chunk": 1,
        "cpu_kv_cache_size_bytes": s.kv_offload_num_blocks * s.kv_offload_bytes_per_block,
        # Tokens it holds for requests of max_model_len tokens, as vLLM counts them.
        "cpu_kv_cache_size_tokens": (
            s.kv_offload_num_blocks * max_model_len // -(-max_model_len // s.block_size)
        ),
    }
    g = GaugeMetricFamily(
        "vllm:kv_offload_config_info",
        "Static configuration of the KV offload managers of this engine instance.",
        labels=[*LABEL_NAMES, *info],
    )
    g.add_metric([*labels, *(str(v) for v in info.values())], 1)
    yield g
    yield gauge(
        "fleetpilot_kv_offload_cpu_blocks_used",
        "KV blocks held in the host tier (of vllm:kv_offload_config_info's cpu_num_chunks).",
        s.kv_offload_blocks_used,
    )
    yield counter(
        "fleetpilot_kv_offload_cpu_evictions",
        "KV blocks the host tier evicted (least recently used) to store others.",
        s.kv_offload_evictions_total,
    )
