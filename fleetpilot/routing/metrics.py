"""The router's Prometheus metrics, in a registry per app (tests run several routers in one
process, and a module-level registry would mix their counts)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Decision time is tens of microseconds; buckets from 10 us to 50 ms.
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)
# vLLM's TTFT buckets, so router-observed and engine-observed TTFT line up in one dashboard.
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
# vLLM's e2e latency buckets.
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on
MATCH_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
# Where a prompt's KV blocks come from, in ``Route.kv_blocks`` order.
KV_BLOCK_SOURCES = ("device", "host", "computed")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    """Every metric the router exports, registered in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "fleetpilot_router_"
        self.requests = Counter(
            p + "requests",
            "Routed requests by tier, replica and final HTTP status.",
            ["tier", "replica", "status"],
            registry=r,
        )
        self.rejected = Counter(
            p + "rejected_requests",
            "Requests answered by the router itself (bad input, overload, no replicas).",
            ["status", "code"],
            registry=r,
        )
        self.tenant_requests = Counter(
            p + "tenant_requests",
            "Requests whose API key a tenant holds (routing.auth), by tenant.",
            ["tenant"],
            registry=r,
        )
        self.queued = Gauge(
            p + "queued_requests",
            "Requests waiting for capacity in the fair queue (routing.flow), by tenant.",
            ["tenant"],
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            p + "queue_wait_seconds",
            "How long requests that got capacity waited for it in the fair queue, by tenant.",
            ["tenant"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=r,
        )
        self.auth_keys = Gauge(
            p + "auth_keys",
            "API keys loaded per tenant (routing.auth).",
            ["tenant"],
            registry=r,
        )
        self.decisions = Counter(
            p + "decisions",
            "Tier decisions by tier and reason (complexity, header, model, spillover).",
            ["tier", "reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            p + "decision_seconds",
            "Time to choose the tier and replica(s).",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            p + "time_to_first_token_seconds",
            "Router-observed time from request arrival to the first streamed chunk.",
            ["tier"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            p + "e2e_request_latency_seconds",
            "Router-observed time from request arrival to the end of the response.",
            ["tier"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prefix_match = Histogram(
            p + "predicted_prefix_match_ratio",
            "Predicted fraction of the prompt's blocks cached on the chosen replica, on its device "
            "or in host memory.",
            ["tier"],
            buckets=MATCH_BUCKETS,
            registry=r,
        )
        self.kv_blocks = Counter(
            p + "predicted_kv_blocks",
            "Prompt KV blocks of the requests whose engines' KV events judged them, by where "
            "the chosen (prefilling) replica was predicted to get them: device (its KV cache), "
            "host (copied back from host memory: KV offloading) or computed.",
            ["tier", "source"],
            registry=r,
        )
        self.spillovers = Counter(
            p + "spillovers",
            "Requests sent to a higher tier because their own was saturated.",
            ["from_tier", "to_tier"],
            registry=r,
        )
        self.stream_resumes = Counter(
            p + "stream_resumes",
            "Streams whose replica died or froze mid-answer, by what became of them: resumed "
            "on another replica, or ended with an error event (no_replica, not_resumable, "
            "exhausted, failed).",
            ["tier", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            p + "retries",
            "Attempts repeated on another replica after a connect error, a 5xx, or a 404 for a "
            "LoRA adapter the replica has not loaded yet.",
            ["tier"],
            registry=r,
        )
        self.adapter_missing = Counter(
            p + "adapter_missing",
            "Attempts answered 404 by a replica that has not loaded the request's LoRA adapter "
            "yet (dynamic LoRA loads it after the pod is ready): retried on another replica "
            "where one is left, not counted as upstream errors.",
            ["tier", "replica"],
            registry=r,
        )
        self.ejections = Counter(
            p + "ejections",
            "Replicas ejected after repeated failures.",
            ["tier", "replica"],
            registry=r,
        )
        self.readmissions = Counter(
            p + "readmissions",
            "Ejected replicas readmitted after a passing /health probe.",
            ["replica"],
            registry=r,
        )
        self.pd_local_prefills = Counter(
            p + "pd_local_prefills",
            "Disaggregated requests sent to a decode replica that holds all but a few of the "
            "prompt's tokens, which it computes itself (no prefill hop).",
            ["tier"],
            registry=r,
        )
        self.pd_fallbacks = Counter(
            p + "pd_fallbacks",
            "Disaggregated requests served unified on the decode replica (prefill hop failed).",
            ["tier", "cause"],
            registry=r,
        )
        self.upstream_errors = Counter(
            p + "upstream_errors",
            "Failed upstream attempts by cause (connect, disconnect, timeout, 5xx, stream).",
            ["tier", "replica", "cause"],
            registry=r,
        )
        self.in_flight = Gauge(
            p + "in_flight_requests", "Requests the router is handling now.", registry=r
        )
        self.unfinished = Gauge(
            p + "unfinished_requests",
            "Requests from their headers to their end, bodies still arriving included "
            "(in_flight_requests counts those whose body arrived).",
            registry=r,
        )
        self.endpoints = Gauge(
            p + "endpoints",
            "Discovered Ready endpoints by tier, role and state (active or ejected).",
            ["tier", "role", "state"],
            registry=r,
        )
        self.pending = Gauge(
            p + "pending_requests",
            "Requests held because their tier has no replica (cold start); the autoscaler "
            "scales such a tier from zero on it.",
            ["tier", "role"],
            registry=r,
        )
        self.config_reloads = Counter(
            p + "config_reloads",
            "Config file changes by result: applied, invalid, unreadable, failed (valid but "
            "not applied). A refused change is counted once, not per poll.",
            ["result"],
            registry=r,
        )
        self.file_reloads = Counter(
            p + "file_reloads",
            "Changes of the other files the router re-reads (file: endpoints, auth_keys) by "
            "result: applied, invalid, unreadable. A refused change is counted once.",
            ["file", "result"],
            registry=r,
        )
        self.scrape_errors = Counter(
            p + "scrape_errors", "Failed /metrics scrapes of replicas.", ["replica"], registry=r
        )
        self.kv_events = Counter(
            p + "kv_events",
            "KV-cache events applied to the router's KV index, by replica.",
            ["replica"],
            registry=r,
        )
        self.kv_event_errors = Counter(
            p + "kv_event_errors",
            "KV-event trouble by replica and cause: malformed, oversize, invalid_event, "
            "unknown_parent (blocks), gap, replay, replay_timeout, lost (batches), restart, "
            "silent, placeholder (host-tier stores without content: the engine's offloading "
            "connector needs kv_connector_extra_config.self_describing_kv_events).",
            ["replica", "cause"],
            registry=r,
        )
        self.kv_events_live = Gauge(
            p + "kv_events_live",
            "1 while a replica's KV-event publisher is heard from (the KV index decides for "
            "it), 0 while it is silent or down (the guessed index decides).",
            ["replica"],
            registry=r,
        )
        self.kv_index_blocks = Gauge(
            p + "kv_index_blocks",
            "(replica, block) entries in the KV-event index, the quantity its LRU bounds.",
            registry=r,
        )
        self.prefix_source = Counter(
            p + "prefix_source",
            "Replica decisions by what judged the prompt's cached prefix: events (the engines' "
            "KV events, every replica of the group publishing) or guessed (the router's record "
            "of what it sent where).",
            ["tier", "source"],
            registry=r,
        )
        self.replica_requests = Gauge(
            p + "replica_requests",
            "Requests in flight at each replica as this router counts them: its own (self) "
            "and its peer routers' as of their last exchange (peers).",
            ["replica", "counted_by"],
            registry=r,
        )
        self.peers = Gauge(
            p + "peers",
            "Other router replicas whose in-flight counts this one adds (live), and those "
            "that missed 3 asks in a row, whose counts no longer count (lost).",
            ["state"],
            registry=r,
        )
        self.peer_errors = Counter(
            p + "peer_errors",
            "Failed reads of a peer router's counts, by error.",
            ["error"],
            registry=r,
        )
        self.tokenizer_loaded = Gauge(
            p + "tokenizer_loaded",
            "1 once a tier's tokenizer is loaded (its prompts are matched against the KV-event "
            "index), 0 while it is loading or failed to load (the guessed index decides).",
            ["tier"],
            registry=r,
        )
        self.tokenizer_errors = Counter(
            p + "tokenizer_errors",
            "Requests the router could not tokenize for the KV index (template error, bad or "
            "oversize prompt); they are routed on the guessed index.",
            ["tier"],
            registry=r,
        )
        self._request_children: dict[tuple[str, str, str], Any] = {}
        self._source_children: dict[tuple[str, str], Any] = {}
        self._e2e_children: dict[str, Any] = {}
        self._decision_children: dict[tuple[str, str], Any] = {}
        self._match_children: dict[str, Any] = {}
        self._block_children: dict[str, tuple[Any, ...]] = {}

    # The hot path's label lookups, cached: prometheus_client's labels() costs a lock and a
    # tuple build per call, several times per request.
    def count_request(self, tier: str, replica: str, status: str, seconds: float) -> None:
        key = (tier, replica, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(tier, replica, status)
        child.inc()
        e2e = self._e2e_children.get(tier)
        if e2e is None:
            e2e = self._e2e_children[tier] = self.e2e_seconds.labels(tier)
        e2e.observe(seconds)

    def count_decision(
        self,
        tier: str,
        reason: str,
        prefix_match: float,
        source: str = "guessed",
        kv_blocks: tuple[int, int, int] | None = None,
    ) -> None:
        by_source = self._source_children.get((tier, source))
        if by_source is None:
            by_source = self._source_children[(tier, source)] = self.prefix_source.labels(
                tier, source
            )
        by_source.inc()
        key = (tier, reason)
        child = self._decision_children.get(key)
        if child is None:
            child = self._decision_children[key] = self.decisions.labels(tier, reason)
        child.inc()
        match = self._match_children.get(tier)
        if match is None:
            match = self._match_children[tier] = self.prefix_match.labels(tier)
        match.observe(prefix_match)
        if kv_blocks is not None:
            blocks = self._block_children.get(tier)
            if blocks is None:
                blocks = self._block_children[tier] = tuple(
                    self.kv_blocks.labels(tier, s) for s in KV_BLOCK_SOURCES
                )
            for child, n in zip(blocks, kv_blocks, strict=True):
                if n:
                    child.inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
