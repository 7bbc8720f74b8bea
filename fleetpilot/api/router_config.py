"""The router's versioned configuration, written by the operator into a ConfigMap.

The router reads only this file, never the InferenceService: it needs no access to custom
resources, and the config it runs with can be inspected with ``kubectl get configmap``.
"""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from fleetpilot.api.base import ApiModel
from fleetpilot.api.spec import Affinity, RoleName, ServingMode, Spillover
from fleetpilot.api.units import Duration

ROUTER_CONFIG_FILE = "router.yaml"


def _positive_budget(value: timedelta | None) -> timedelta | None:
    # 0 would end every attempt before its first byte; refuse it rather than read it as "off".
    if value is not None and value <= timedelta(0):
        raise ValueError("firstByteTimeout must be positive, e.g. 2s")
    return value


class EndpointGroup(ApiModel):
    """The engine pods of one role of a tier, as the router discovers them."""

    role: RoleName
    service: str = Field(description="Headless Service whose EndpointSlices list the pods.")
    selector: dict[str, str] = Field(description="Pod labels of this group.")
    port: int = Field(ge=1, le=65535)
    max_num_seqs: int = Field(ge=1, description="Engine batch limit: the saturation point.")
    addresses: list[str] = Field(
        default_factory=list,
        description=(
            "Static 'host:port' endpoints of this group (the local runtime); empty: discover "
            "the Ready endpoints of the Service's EndpointSlices."
        ),
    )
    kv_events_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Port of each engine's KV-event publisher (vLLM --kv-events-config endpoint; rank r "
            "of a data-parallel replica publishes on port + r); unset: the engines publish no "
            "events and the router guesses what they cache."
        ),
    )
    kv_replay_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of each engine's KV-event replay socket (plus the rank, as above).",
    )
    data_parallel: int = Field(
        1, ge=1, le=64, description="Data-parallel ranks behind one endpoint (one stream each)."
    )
    block_size: int = Field(
        16,
        ge=1,
        le=1024,
        description=(
            "The engines' KV block size in tokens, until their events report one: what the "
            "router cuts a prompt into to match it against the KV index."
        ),
    )


class RouterTier(ApiModel):
    name: str
    model: str = Field(description="Name clients request (the tier's served model name).")
    adapters: list[str] = Field(
        default_factory=list,
        description="LoRA adapters the tier's engines serve: other names clients may request.",
    )
    max_loras: int = Field(
        1, ge=1, description="Adapters one engine runs at once (its --max-loras)."
    )
    up_to: float = Field(ge=0.0, le=1.0)
    mode: ServingMode
    endpoints: list[EndpointGroup]
    first_byte_timeout: Duration | None = Field(
        None,
        description=(
            "This tier's time-to-first-byte budget per upstream attempt (and for the prefill "
            "hop); unset: the config-wide firstByteTimeout. The planner derives it from the "
            "tier's SLO: max(2s, 4 x ttftP95)."
        ),
    )

    tokenizer: str | None = Field(
        None,
        description=(
            "Where the router loads the tier model's tokenizer (tokenizer.json and "
            "tokenizer_config.json) to match requests against the engines' KV events: a local "
            "directory, or hf://<repo>@<revision>. Unset: the router guesses from prompt text."
        ),
    )

    cold_start_observed: Duration | None = Field(
        None,
        description=(
            "The tier's observed cold start: the longest pod-created-to-Ready among the kept "
            "starts of its roles (status coldStart.pod.maxSeconds), which sets how long a "
            "request for the tier is held while the tier is at zero (coldStartWait); unset: "
            "none observed yet."
        ),
    )

    _check_first_byte_timeout = field_validator("first_byte_timeout")(_positive_budget)


class Ejection(ApiModel):
    """When a replica stops getting traffic, and how it comes back."""

    failures: int = Field(
        3, ge=1, le=1000, description="Failures (connect errors, 5xx) within window that eject."
    )
    window: Duration = Field(timedelta(seconds=30), description="Failure counting window.")
    probe_interval: Duration = Field(
        timedelta(seconds=2), description="How often an ejected replica's /health is probed."
    )
    # 0.1: a tenth of the default 5 s budget is 0.5 s; with the router's /health question then
    # (250 ms, ``upstream.SUSPICION_PROBE_S``) and its 50 ms polls, a replica frozen under a
    # request is passed over, and that request moved, within about 0.8 s: under a second, so
    # two clients on a tier of two never see a second without an answer. The wait alone
    # decides nothing - a live replica answers the question - so a small fraction costs a
    # healthy replica one /health request per slow request, at most one at a time.
    suspect_fraction: float = Field(
        0.1,
        gt=0.0,
        le=1.0,
        description=(
            "A replica where a request has waited this fraction of the first-byte budget for "
            "its first byte (its /health is asked then) while its last scrape or /health probe "
            "went unanswered is suspect: passed over for new requests, and its waiting "
            "requests go elsewhere, until it answers anything."
        ),
    )


class Scrape(ApiModel):
    """Reading each replica's /metrics for queue length and KV-cache usage."""

    interval: Duration = Field(timedelta(seconds=1), description="Scrape period.")
    timeout: Duration = Field(timedelta(milliseconds=800), description="Per-scrape timeout.")
    # Five missed scrapes: older data describes a queue that has long since changed.
    stale_after: Duration = Field(
        timedelta(seconds=5), description="Scraped values older than this are ignored."
    )


class Backpressure(ApiModel):
    """When the router refuses work (429) instead of queueing it."""

    max_waiting_per_replica: int = Field(
        64,
        ge=0,
        description=(
            "A replica is full when this many requests wait beyond its max_num_seqs; a request "
            "for which every eligible replica is full gets 429."
        ),
    )
    max_in_flight: int = Field(
        8192,
        ge=1,
        description="Requests the router process holds at once, counted once their body has "
        "arrived (a body still being sent holds no slot); beyond: 429.",
    )
    retry_after: Duration = Field(timedelta(seconds=1), description="Retry-After sent with a 429.")
    # Unset: a quarter of maxInFlight, so that no single client - however slowly it sends -
    # holds more than a quarter of the router, and four clients at their cap still leave it
    # room (8192 / 4 = 2048 by default, far above what one real client keeps open).
    max_unfinished_per_client: int | None = Field(
        None,
        ge=0,
        description=(
            "Unfinished requests (still sending their body, or being answered) one client may "
            "have at once; beyond: 429 with Retry-After, before its body is read. A client is "
            "its tenant when API keys are on, else its source address. Behind a load balancer "
            "or ingress that does not keep client addresses, every request comes from the "
            "proxy's few addresses and the per-address cap limits them all together: size it "
            "for one proxy replica, set 0 to turn it off, or turn API keys on (the cap is then "
            "per tenant). X-Forwarded-For is not used: any client can write it. Unset: "
            "maxInFlight / 4."
        ),
    )

    def per_client_cap(self) -> int | None:
        """Unfinished requests allowed per client; None: no cap."""
        if self.max_unfinished_per_client is None:
            return max(1, self.max_in_flight // 4)
        return self.max_unfinished_per_client or None


class TenantKeys(ApiModel):
    """One tenant's keys, as files in the router's pod, and what they may use."""

    name: str = Field(min_length=1, max_length=63)
    key_files: list[str] = Field(
        min_length=1,
        description="Files holding the tenant's API keys, one per line (blank lines and lines "
        "starting with '#' ignored); re-read when they change.",
    )
    tiers: list[str] = Field(default_factory=list, description="Tiers it may use; empty: all.")
    adapters: list[str] = Field(
        default_factory=list, description="Adapters it may request; empty: all."
    )
    requests_per_minute: int | None = Field(
        None, ge=1, description="For the whole service; this router admits its share."
    )
    tokens_per_minute: int | None = Field(
        None, ge=1, description="For the whole service; this router admits its share."
    )
    weight: float = Field(1.0, gt=0.0, description="Its share when the fleet is saturated.")
    priority: int = Field(0, ge=0, description="Its class when the fleet is saturated.")


class AuthConfig(ApiModel):
    """API keys the router checks before any routing work."""

    tenants: list[TenantKeys] = Field(min_length=1)
    router_replicas: int = Field(
        1, ge=1, description="Routers sharing the tenants' limits: each admits 1/this of them."
    )
    reload_interval: Duration = Field(
        timedelta(seconds=5), description="How often the key files are checked for changes."
    )


class FlowConfig(ApiModel):
    """Queueing while every replica that could serve a request is saturated."""

    max_wait: Duration = Field(timedelta(seconds=30))
    max_queued: int = Field(1024, ge=1)
    headroom: int = Field(
        2,
        ge=0,
        description="Batch slots of a tier each other active tenant keeps free for its next "
        "requests (within its weighted share); 0: work-conserving.",
    )


class Peers(ApiModel):
    """The other replicas of this router, which share their in-flight counts per engine
    (``routing.peers``): each router's view of a replica adds what its peers have there."""

    service: str | None = Field(
        None,
        description="DNS name of the routers' headless Service; its addresses are the peers "
        "(this router among them, which it recognises and skips).",
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port the peers serve their counts on (their metricsPort, else their "
        "public port); unset: this router's own.",
    )
    addresses: list[str] = Field(
        default_factory=list, description="Static 'host:port' peers (the local runtime)."
    )
    interval: Duration = Field(
        timedelta(milliseconds=100),
        description="How often each peer is asked; a peer that misses 3 asks in a row is dropped.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.service is None and not self.addresses:
            raise ValueError("peers needs a service or addresses")
        if self.interval <= timedelta(0):
            raise ValueError("peers.interval must be positive, e.g. 100ms")
        return self


class HostBlocks(StrEnum):
    """How the router's KV index reads the blocks an engine holds in host memory (vLLM's KV
    offloading, ``--kv-offloading-size``: ``CPU``-medium KV events)."""

    # A host block after the device hit is priced at hostHitCost: a copy back, not a prefill.
    TIERED = "tiered"
    # Medium-blind: a block on any medium counts as a device hit, as llm-d's precise prefix
    # scorer did before it weighed tiers - the baseline the tiered scorer is measured against.
    AS_DEVICE = "asDevice"
    # Host-tier events are dropped (counted): the index knows the device cache only, as
    # fleetpilot's did before issue 46.
    IGNORED = "ignored"


# What a block in host memory costs, in blocks of prefill: the copy back over PCIe against
# the prefill it saves. An 8B model (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes)
# has 128 KiB of KV a token; PCIe Gen5 x16 carries 64 GB/s nominal a direction, ~25 GB/s
# effective for the scattered per-layer block copies of the offloading connector, so ~190k
# tokens/s come back from host memory, where an H100 prefills ~10-25k tokens/s: a host block
# costs 0.05-0.13 of a recomputed one. A 70B model on 4 x H100 (TP 4: a quarter of its 320
# KiB a token over each GPU's own link, ~300k tokens/s, against ~13k tokens/s of prefill) and
# an 8B model on an L4 (PCIe Gen4, ~12 GB/s: ~90k tokens/s against ~3-4k) land at ~0.04: both
# the link and the compute grow with the GPU's class. 0.1, the upper end: a copy shares the
# memory bus with the running batch, and a lower price would move a request to a host hit
# behind a queue that a device-cold replica would have served sooner.
HOST_HIT_COST = 0.1


class KVIndexConfig(ApiModel):
    """The router's index of what the engines cache, from their KV events."""

    host_blocks: HostBlocks = Field(
        HostBlocks.TIERED,
        description=(
            "How blocks an engine holds in host memory (KV offloading) count: tiered (after "
            "the device hit, the run of host blocks is priced at hostHitCost), asDevice "
            "(medium-blind: as device hits) or ignored (host-tier events dropped)."
        ),
    )
    host_hit_cost: float = Field(
        HOST_HIT_COST,
        ge=0.0,
        le=1.0,
        description=(
            "What a prompt block in host memory costs, as a fraction of computing it: 0 is a "
            "device hit, 1 a miss. Its copy back to the GPU against its prefill: ~0.05-0.1 on "
            "PCIe Gen5 and Gen4 GPUs alike."
        ),
    )
    max_blocks: int | None = Field(
        None,
        ge=1,
        description=(
            "Bound on the index's (replica, engine block) entries, the blocks of every medium "
            "the fleet's engines hold (~360 bytes each, ~400 on both media); unset: 2**19, 16 "
            "engines of 32k device blocks. Offloading engines hold their host tier's blocks "
            "too: size it from the fleet's host KV blocks."
        ),
    )


class RouterConfig(ApiModel):
    """``fleetpilot.dev/v1alpha1 RouterConfig``."""

    api_version: Literal["fleetpilot.dev/v1alpha1"] = "fleetpilot.dev/v1alpha1"
    kind: Literal["RouterConfig"] = "RouterConfig"
    service: str
    namespace: str
    port: int = Field(8000, ge=1, le=65535)
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Port of a second listener that serves only /metrics and /health, for Prometheus: "
            "the public port then answers 404 for /metrics, so clients never read replica "
            "addresses, tenant names or per-tenant counts. Unset: /metrics on the public "
            "port while auth is unset, and on no port while it is set. Read at start only."
        ),
    )
    epp_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Port of a gRPC listener serving the Gateway API Inference Extension's endpoint "
            "picker protocol (Envoy ext_proc) and gRPC health: a gateway's InferencePool "
            "asks it which replica each request goes to, decided as the router hop decides. "
            "Unset: no picker. Read at start only."
        ),
    )
    epp_tls: bool = Field(
        False,
        description=(
            "Serve the endpoint picker over TLS with a self-signed certificate made at start, "
            "as the extension's own picker does by default: gateways connect to a picker with "
            "TLS and do not verify its certificate. Read at start only."
        ),
    )
    tiers: list[RouterTier] = Field(min_length=1)
    auth: AuthConfig | None = Field(
        None, description="API keys per tenant; unset: every request is admitted."
    )
    flow: FlowConfig | None = Field(
        None, description="Fair queuing under saturation; unset: 429 at once."
    )
    affinity: Affinity = Field(default_factory=Affinity)
    kv_index: KVIndexConfig = Field(default_factory=KVIndexConfig)
    load_weight: float = Field(1.0, ge=0.0)
    adapter_weight: float = Field(2.0, ge=0.0)
    retries: int = Field(2, ge=0)
    stream_resumes: int = Field(
        1,
        ge=0,
        description="Times a stream whose replica dies or freezes mid-answer continues on "
        "another replica; 0: it ends with an error event.",
    )
    spillover: Spillover = Field(default_factory=Spillover)
    request_timeout: Duration = Field(timedelta(minutes=10))
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1)
    # The fields below are router tuning with defaults; the planner need not write them.
    connect_timeout: Duration = Field(
        timedelta(seconds=2),
        description="TCP connect limit per upstream attempt: a dead replica costs at most this.",
    )
    # A frozen engine (SIGSTOPped, wedged) accepts connections and never answers, so no
    # connect timeout catches it. Past this budget with no response yet, the replica must
    # prove it is alive (a /health probe, started early enough to be answered by the budget's
    # end): if it cannot, the attempt is a failure and goes to another replica. A replica that
    # is alive keeps the request: a long non-streamed generation sends its first byte only
    # when it is done. 5 s: well past any TTFT a fleet without an SLO would accept, and short
    # enough that a freeze costs a client seconds, not the request timeout.
    first_byte_timeout: Duration = Field(
        timedelta(seconds=5),
        description=(
            "Time-to-first-byte budget per upstream attempt and for the prefill hop, for tiers "
            "without their own: past it, a replica that also fails a /health probe counts a "
            "failure (towards ejection) and the request is retried on another replica; a "
            "prefill hop past it falls back to decode-only."
        ),
    )
    _check_first_byte_timeout = field_validator("first_byte_timeout")(_positive_budget)
    debug_route_header: bool = Field(
        False,
        description=(
            "Show replica addresses (replica=, prefill=) in the x-fleetpilot-route response "
            "header. Off by default: clients need not learn the fleet's internal addresses."
        ),
    )
    # Per replica, as many prompt blocks as its KV cache holds: an 8B model (128 KiB of fp16
    # KV per token) with ~60 GiB of KV on an 80 GB GPU holds ~490k tokens; at ~4 characters per
    # token a 64-character block is ~16 tokens, so ~30k blocks; 32768 rounds it up. Remembering
    # more than the cache holds would predict hits the engine has already evicted.
    prefix_index_blocks: int = Field(
        32768, ge=1, description="Per-replica LRU size of the prefix-block index."
    )
    ejection: Ejection = Field(default_factory=Ejection)
    cold_start_wait: Duration = Field(
        timedelta(0),
        description=(
            "The longest a request waits when no tier in reach has a replica (a tier scaled to "
            "zero): it is counted in fleetpilot_router_pending_requests, which the autoscaler "
            "reads to scale the tier from zero. Within it, a tier with an observed cold start "
            "holds for coldStartFactor x that + coldStartMargin; then 503 with Retry-After. "
            "0 answers 503 at once."
        ),
    )
    # A new start is slower than the slowest kept one now and then (a colder node, a busier
    # registry): 1.5x covers that spread. The margin covers what the observation (pod created
    # to Ready) leaves out: the autoscaler seeing the held request (its 5 s tick) and the
    # pod's creation before it, the Ready endpoint reaching the router after; the operator
    # adds its Prometheus scrape interval, the delay before the autoscaler can see it at all.
    cold_start_factor: float = Field(
        1.5,
        ge=1.0,
        le=100.0,
        description="Hold for a tier at zero: this many times its observed cold start ...",
    )
    cold_start_margin: Duration = Field(
        timedelta(seconds=10), description="... plus this (and at most coldStartWait)."
    )
    scrape: Scrape = Field(default_factory=Scrape)
    backpressure: Backpressure = Field(default_factory=Backpressure)
    peers: Peers | None = Field(
        None, description="Router replicas to share in-flight counts with; unset: alone."
    )

    @model_validator(mode="after")
    def _check_metrics_port(self) -> Self:
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(
                f"metricsPort {self.metrics_port} is the public port: give /metrics a port "
                "of its own, or leave metricsPort unset"
            )
        if self.epp_port is not None and self.epp_port in (self.port, self.metrics_port):
            raise ValueError(
                f"eppPort {self.epp_port} is taken by the public or metrics port: give the "
                "endpoint picker a port of its own"
            )
        if self.peers is not None and self.auth is not None and self.metrics_port is None:
            raise ValueError(
                "peers: with API keys on, routers serve their counts only on metricsPort; "
                "set metricsPort"
            )
        return self
