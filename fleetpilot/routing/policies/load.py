"""Replica load: what a replica is doing, read from the router's own in-flight counts and the
engine's scraped ``/metrics``. Purely computational.

Two sources, because each alone misleads: in-flight counts are exact and instant but only see
this router process (a fleet runs several); scraped ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` see every client but are up to one scrape interval old, and are
dropped entirely once older than a bound (a stale queue length is worse than none).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from fleetpilot.routing.policies.types import PickRequest, ReplicaView

# Weights of the load components; they sum to 1 so the load stays in [0, 1]. Occupancy (how
# full the batch is) dominates; the queue and KV pressure tell apart replicas whose batches are
# both full, which is where the choice matters most.
OCCUPANCY_WEIGHT = 0.5
QUEUE_WEIGHT = 0.3
KV_WEIGHT = 0.2

_WAITING = ("vllm:num_requests_waiting",)
_RUNNING = ("vllm:num_requests_running",)
# vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc in v0.10; accept both.
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# LoRA adapters of running and waiting requests, in labels; the value is when they were seen.
_LORA_INFO = "vllm:lora_requests_info"
_LORA_LABELS = ("running_lora_adapters", "waiting_lora_adapters")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """The scraped gauges the router uses, summed over an engine's label sets (DP ranks)."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    # LoRA adapters the engine's running and waiting requests use (so it has them loaded).
    adapters: frozenset[str] = frozenset()


def parse_engine_metrics(text: str) -> EngineMetrics | None:
    """Read the three gauges from Prometheus text exposition; ``None`` if none is present.

    A hand-rolled scan, not a full exposition parser: the router scrapes every replica every
    second and needs three gauges out of a few hundred lines. Sample lines are
    ``name{labels} value [timestamp]``; several label sets (data-parallel ranks) are summed,
    and KV usage is averaged over them since it is a fraction. ``vllm:lora_requests_info``
    keeps a series for every set of adapters it ever reported (its value is when): the newest
    one says which adapters run now.
    """
    waiting = running = kv_sum = 0.0
    kv_count = 0
    seen = False
    lora_at = -math.inf
    adapters: frozenset[str] = frozenset()
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            end = line.rfind("}")
            rest = line[end + 1 :].split()
        else:
            name = line[:space] if space != -1 else line
            rest = line[space + 1 :].split() if space != -1 else []
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if math.isnan(value) or math.isinf(value) or value < 0:
            continue
        if name in _WAITING:
            waiting += value
            seen = True
        elif name in _RUNNING:
            running += value
            seen = True
        elif name in _KV:
            kv_sum += value
            kv_count += 1
            seen = True
        elif name == _LORA_INFO and value >= lora_at:
            lora_at = value
            labels = dict(_LABEL.findall(line[brace:end])) if brace != -1 else {}
            adapters = frozenset(
                a for key in _LORA_LABELS for a in labels.get(key, "").split(",") if a
            )
    if not seen:
        return None
    kv = min(1.0, kv_sum / kv_count) if kv_count else 0.0
    return EngineMetrics(waiting=waiting, running=running, kv_usage=kv, adapters=adapters)


def make_view(
    replica_id: str,
    max_num_seqs: int,
    in_flight: int,
    metrics: EngineMetrics | None,
    scraped_at: float | None,
    now: float,
    stale_after_s: float,
    ejected: bool = False,
    pending_prefill: float = 0.0,
    adapters: frozenset[str] = frozenset(),
    adapter_lru_at: float = -math.inf,
    missing_adapters: frozenset[str] = frozenset(),
    *,
    hangs: bool = False,
    suspect: bool = False,
    recent_sends: float = 0.0,
) -> ReplicaView:
    """A view of a replica, ignoring scraped metrics older than ``stale_after_s``;
    ``adapters``: those the router itself sent there lately (the scrape's are added), the
    least recent of them sent at ``adapter_lru_at`` (-inf: a slot is free);
    ``missing_adapters``: those the replica lately answered it does not have, taken out of
    ``adapters`` (a 404 is newer news than a send, and the router drops a mark that a later
    scrape contradicts)."""
    fresh = metrics is not None and scraped_at is not None and now - scraped_at <= stale_after_s
    if not fresh or metrics is None:
        return ReplicaView(
            replica_id,
            max_num_seqs,
            in_flight,
            ejected=ejected,
            hangs=hangs,
            suspect=suspect,
            pending_prefill=pending_prefill,
            adapters=adapters - missing_adapters if missing_adapters else adapters,
            adapter_lru_at=adapter_lru_at,
            missing_adapters=missing_adapters,
            recent_sends=recent_sends,
        )
    adapters = adapters | metrics.adapters
    return ReplicaView(
        replica_id,
        max_num_seqs,
        in_flight,
        waiting=metrics.waiting,
        running=metrics.running,
        kv_usage=metrics.kv_usage,
        ejected=ejected,
        hangs=hangs,
        suspect=suspect,
        pending_prefill=pending_prefill,
        adapters=adapters - missing_adapters if missing_adapters else adapters,
        adapter_lru_at=adapter_lru_at,
        missing_adapters=missing_adapters,
        recent_sends=recent_sends,
    )


def load_of(view: ReplicaView, queue_threshold: float) -> float:
    """Load in [0, 1]: batch occupancy, queue length relative to the threshold, KV usage."""
    occupancy = min(1.0, view.demand / view.max_num_seqs)
    queue = min(1.0, view.queued / (queue_threshold + 1.0)) if view.queued > 0 else 0.0
    kv = min(1.0, max(0.0, view.kv_usage))
    return OCCUPANCY_WEIGHT * occupancy + QUEUE_WEIGHT * queue + KV_WEIGHT * kv


# KV usage from which a replica counts as pressed: past it, a new request's blocks are taken
# from the cached-but-free ones (evicting the prefixes that made the replica attractive), and
# vLLM starts preempting running requests as usage nears 1.
KV_PRESSURE = 0.9


def has_headroom(view: ReplicaView) -> bool:
    """Whether one more request runs at once here: nothing queued (by the engine's count or
    ours), a free batch slot, and KV usage below ``KV_PRESSURE``. What a replica's share of
    the group's in-flight requests is does not matter: a busy replica with free slots serves
    a prompt whose prefix it caches faster than an idle one that must compute it."""
    return view.queued <= 0 and view.demand < view.max_num_seqs and view.kv_usage < KV_PRESSURE


def is_full(view: ReplicaView, max_waiting: int) -> bool:
    """Whether the replica must take no more work: its queue is at the hard limit."""
    return view.queued >= max_waiting or view.in_flight >= view.max_num_seqs + max_waiting


def is_saturated(view: ReplicaView, queue_threshold: float) -> bool:
    """Whether a new request would queue: batch full or a queue above the threshold."""
    return view.queued > queue_threshold or view.demand >= view.max_num_seqs


def group_saturated(views: Sequence[ReplicaView], queue_threshold: float) -> bool:
    """A group is saturated when its mean queue per replica is above the threshold, or when
    every replica's batch is full (so the next request waits wherever it goes)."""
    if not views:
        return True
    mean_queue = sum(v.queued for v in views if v.queued > 0) / len(views)
    if mean_queue > queue_threshold:
        return True
    return all(v.demand >= v.max_num_seqs for v in views)


class LoadScorer:
    """Scorer: ``1 - load`` in [0, 1], so the least-loaded replica scores highest."""

    name = "load"

    def __init__(self, queue_threshold: float) -> None:
        self.queue_threshold = queue_threshold

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        return {v.id: 1.0 - load_of(v, self.queue_threshold) for v in replicas}
