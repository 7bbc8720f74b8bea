"""The router's decisions: which tier, which replica. No I/O.

``Router`` owns the mutable state the pure policies read - per-replica in-flight counts,
scraped engine metrics, the KV index (what the engines' KV events say they cache), the guessed
prefix index (what this router sent where) and the ejection tracker - and runs the policies over
it. The HTTP layer (``proxy``) calls ``decide`` and reports back successes and failures; the
app's ``KVEventsClient`` feeds ``kv_index`` and says which event streams are live.

Which index judges a group's replicas: the KV index when the tier has a tokenizer and every
replica of the group publishes live events (then N router processes, reading the same streams,
score a prompt alike); otherwise the guessed index for the whole group, so one silent publisher
never sets a truthful "nothing cached" against a guess of "cached".

Tokenizing a long cold prompt for those keys costs tens of milliseconds: ``prepare_keys`` says
which keys ``decide`` would compute and whether that is over ``OFF_LOOP_TOKENIZE_CHARS``, so the
proxy can compute them in a worker thread and hand them to ``decide``.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from yarl import URL

from fleetpilot.api.router_config import RouterConfig, RouterTier
from fleetpilot.api.spec import RoleName, ServingMode
from fleetpilot.routing.discovery import Endpoint, EndpointSource
from fleetpilot.routing.errors import (
    NoReplicaError,
    OverloadedError,
    PermissionDeniedError,
    RouterError,
    UnavailableError,
)
from fleetpilot.routing.features import Kind, RequestFeatures
from fleetpilot.routing.policies.adapters import AdapterHolderFilter, AdapterScorer
from fleetpilot.routing.policies.candidates import (
    FULL_SCAN_MAX,
    HOLDER_CANDIDATES,
    HOME_CANDIDATES,
    SAMPLED_CANDIDATES,
    HashRing,
    holder_candidates,
    sample,
)
from fleetpilot.routing.policies.complexity import (
    DEFAULT_WEIGHTS,
    ComplexityWeights,
    Target,
    TierChoice,
    TierSpec,
    TierState,
    choose_tier,
    resolve_target,
)
from fleetpilot.routing.policies.ejection import HealthTracker
from fleetpilot.routing.policies.kv_index import MAX_MATCH_BLOCKS, KVIndex
from fleetpilot.routing.policies.load import (
    EngineMetrics,
    LoadScorer,
    group_saturated,
    has_headroom,
    make_view,
)
from fleetpilot.routing.policies.picker import (
    CapacityFilter,
    HealthFilter,
    Pick,
    WeightedScorer,
    pick,
)
from fleetpilot.routing.policies.prefix import (
    UNCACHED_BLOCK_COST,
    PrefillCostScorer,
    PrefixIndex,
    block_hashes,
    matched_blocks,
)
from fleetpilot.routing.policies.recent import RecentSends
from fleetpilot.routing.policies.suspicion import FirstByteWaits, is_suspect
from fleetpilot.routing.policies.types import Filter, PickRequest, ReplicaView
from fleetpilot.routing.tokenizer.errors import TokenizerError

log = logging.getLogger(__name__)


# A tie is broken by the key of a block this far past the deepest match in the fleet: far
# enough to clear a chat template's header, which every prompt shares (the reference
# template's is one 16-token block, Llama 3's about two) and a cold fleet caches nowhere
# yet, and near enough to stay inside a tenant's system prompt or a user's own history, so
# the requests that will share a prefix break their ties alike.
TIE_KEY_LOOKAHEAD_BLOCKS = 4

# A P/D request whose prompt the chosen decode replica holds in its KV cache but for at most
# this many tokens (its engine's events say so) skips the prefill hop: the decode replica
# computes those few tokens itself. The hop is a round trip to a prefill replica, a forward
# pass there and a KV pull back; vLLM's NIXL decode side makes the same trade with the same
# number, recomputing rather than pulling fewer remote tokens than its kv_recompute_threshold
# (64 by default). A conversation's next turn on the replica that decoded the last one is the
# common case: its prompt is the last prompt and reply plus a short new message.
PD_LOCAL_PREFILL_TOKENS = 64


# A request whose tokenizing would encode more characters than this (past what the tokenizer's
# prefix cache holds) has its KV-index keys computed in a worker thread (``PreparedKeys``), not on
# the proxy's event loop, where it would stall every stream the router relays. Encoding runs at
# ~0.6 us a character (bench/router_tokenize.py, byte-level BPE), so 2,048 characters stall the
# loop ~1.2 ms at most, a tenth of an engine's ~10-30 ms between two tokens of a stream, and the
# thread hop (~50-100 us) would add a tenth to that. A conversation's next turn (a few hundred
# new characters, ~0.3-0.9 ms) stays inline; a cold 2,000-token conversation (~8k characters,
# ~5 ms) or a cold prompt at the 128k-character cap (~40-80 ms) goes to the thread.
OFF_LOOP_TOKENIZE_CHARS = 2048

# How long a group of over ``candidates.FULL_SCAN_MAX`` replicas keeps its tier state (is any
# replica open, is the group saturated) before reading every replica again: that read is the one
# part of a decision still proportional to the group, and spill-over and 429s turn on the
# group's mean queue, which a few milliseconds do not change (a scraped queue is up to a
# second old anyway). A pick never sends to a full replica: it reads its candidates now.
TIER_STATE_MAX_AGE_S = 0.05

# How long a replica that answered a request for a LoRA adapter with 404 (vLLM's "model does
# not exist") is held not to have it: scored last for it and no holder of it. With dynamic
# LoRA the operator loads a tier's adapters into an engine only after its pod turns Ready
# (``/v1/load_lora_adapter``), so a new or restarted replica lacks them for the second or so
# a load from a volume takes (longer for a Hub download, or until the operator's next sync for
# an engine restarted in place). Ten scrape intervals (1 s by default): a scrape that shows
# the adapter running there, or an answer naming it, ends the mark sooner; once it runs out
# an unloaded replica costs one more 404, which is retried elsewhere.
ADAPTER_MISSING_S = 10.0


class PromptPlan(Protocol):
    """A request's keys, looked up and not yet encoded (``tokenizer.request.KeysPlan``)."""

    @property
    def pending_chars(self) -> int:
        """The characters ``keys`` will encode (past the tokenizer's cached prefix)."""
        ...

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length in tokens once ``keys`` ran; None for a prompt whose keys cover
        only a head cut at a length cap."""
        ...

    def keys(self, block_size: int, lora_name: str | None = None) -> list[bytes]:
        """The chained KV-index keys of the request's prompt; ``TokenizerError`` if it cannot.
        Runs on any thread."""
        ...


class PromptKeys(Protocol):
    """A tier model's tokenizer as the router uses it (``tokenizer.request.RequestTokenizer``)."""

    def plan(self, kind: Kind, payload: Mapping[str, Any]) -> PromptPlan:
        """The request looked up in the tokenizer's cache; ``TokenizerError`` if it cannot."""
        ...

    def remember_reply(self, payload: Mapping[str, Any], reply: str) -> None:
        """Cache the chat's prefix with the engine's reply for its next turn (any thread)."""
        ...


@dataclass(eq=False)
class ReplicaState:
    """What the router tracks about one replica between requests."""

    endpoint: Endpoint
    max_num_seqs: int
    in_flight: int = 0
    pending_prefill: float = 0.0  # see ReplicaView.pending_prefill
    metrics: EngineMetrics | None = None
    scraped_at: float | None = None
    _urls: dict[str, URL] = field(default_factory=dict)
    # The KV index's names of the replica's event streams (one per data-parallel rank).
    kv_streams: tuple[str, ...] = ()
    # The endpoint's "host:port", formatted once: a decision reads it several times for every
    # replica of a group (a thousand-replica group: millions of times a second).
    id: str = field(init=False)
    # Suspicion (``policies.suspicion``): the requests waiting for a first byte here (the
    # proxy's first-byte watch is their one writer), since when its scrapes or probes have
    # gone unanswered with nothing heard from it since (None: it answers), and how long a
    # request waits before that makes it suspect (its tier's budget x ejection.suspectFraction).
    waits: FirstByteWaits = field(default_factory=FirstByteWaits, init=False, repr=False)
    silent_since: float | None = field(default=None, init=False, repr=False)
    suspect_after_s: float = field(default=math.inf, init=False, repr=False)

    # LoRA adapters this router sent requests for here, least recently first (``note_adapter``).
    # Each with when it was last sent: the oldest of ``max_loras`` is the one a new adapter
    # would evict there.
    recent_adapters: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    # The last view made of the replica and what it was made from (``view``).
    _view: ReplicaView | None = field(default=None, init=False, repr=False)
    _view_of: tuple[object, ...] = field(default=(), init=False, repr=False)
    _adapters: frozenset[str] = field(default=frozenset(), init=False, repr=False)
    _adapter_lru_at: float = field(default=-math.inf, init=False, repr=False)
    # LoRA adapters the replica answered it does not have (a 404), each with when: for
    # ``ADAPTER_MISSING_S`` it is held not to have them (``note_adapter_missing``).
    missing_adapters: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _missing: frozenset[str] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        self.kv_streams = tuple(self.endpoint.kv_streams())
        self.id = self.endpoint.id

    def went_silent(self, now: float) -> None:
        """A scrape or /health probe of the replica got no answer at ``now``."""
        if self.silent_since is None:
            self.silent_since = now

    def heard_from(self) -> None:
        """The replica answered something (a scrape, a probe, a first byte): not silent."""
        self.silent_since = None
        self.waits.heard_from()

    def suspect(self, now: float) -> bool:
        """Whether the replica is passed over for new requests now (``is_suspect``)."""
        if self.silent_since is None:  # the common case, read per replica per decision
            return False
        return is_suspect(now, self.waits.oldest(), self.silent_since, self.suspect_after_s)

    def view(
        self, now: float, stale_after_s: float, ejected: bool, hangs: bool = False
    ) -> ReplicaView:
        """The replica as the policies see it now (``load.make_view``): the last view again
        while nothing it shows has changed. A large group's tier state reads every replica's
        view every ``TIER_STATE_MAX_AGE_S``, and between two reads most replicas took no
        request; making a view anew was a third of a simulated decision's CPU at 1,000
        replicas (``bench/simulate_speed.py``)."""
        metrics = self.metrics
        if metrics is not None and (
            self.scraped_at is None or now - self.scraped_at > stale_after_s
        ):
            metrics = None  # stale: the view shows none, as make_view does
        adapters = self._adapters
        missing = self._missing_now(now) if self.missing_adapters else self._missing
        suspect = self.suspect(now)
        made_of = (
            self.in_flight,
            self.pending_prefill,
            self.max_num_seqs,
            ejected,
            hangs,
            suspect,
            metrics,
            adapters,
            self._adapter_lru_at,
            missing,
        )
        view = self._view
        if view is None or made_of != self._view_of:
            view = self._view = make_view(
                self.id,
                self.max_num_seqs,
                self.in_flight,
                metrics,
                self.scraped_at,
                now,
                stale_after_s,
                ejected,
                self.pending_prefill,
                adapters,
                self._adapter_lru_at,
                missing,
                hangs=hangs,
                suspect=suspect,
            )
            self._view_of = made_of
        return view

    def _missing_now(self, now: float) -> frozenset[str]:
        """The adapters the replica is held not to have at ``now``: its marks less those run
        out (``ADAPTER_MISSING_S``) and those a scrape since showed running there."""
        scraped = self.metrics.adapters if self.metrics is not None else frozenset()
        scraped_at = self.scraped_at if self.scraped_at is not None else -math.inf
        gone = [
            adapter
            for adapter, at in self.missing_adapters.items()
            if now - at >= ADAPTER_MISSING_S or (adapter in scraped and scraped_at > at)
        ]
        if gone:
            for adapter in gone:
                del self.missing_adapters[adapter]
            self._missing = frozenset(self.missing_adapters)
        return self._missing

    def note_adapter_missing(self, adapter: str, now: float) -> None:
        """The replica answered at ``now`` that it does not have ``adapter`` (a 404): it has
        not loaded it yet, whatever this router sent there before, so the adapter no longer
        counts among those sent here, and the slot it was thought to take is free."""
        self.missing_adapters[adapter] = now
        self._missing = frozenset(self.missing_adapters)
        if self.recent_adapters.pop(adapter, None) is not None:
            self._adapters = frozenset(self.recent_adapters)
            self._adapter_lru_at = -math.inf  # fewer than max_loras sent: a slot is free

    def note_adapter_served(self, adapter: str) -> None:
        """The replica answered a request for ``adapter``: it has it now."""
        if self.missing_adapters.pop(adapter, None) is not None:
            self._missing = frozenset(self.missing_adapters)

    def note_adapter(self, adapter: str, max_loras: int, now: float) -> list[str]:
        """This router sent a request for ``adapter`` here at ``now``: the engine has it loaded,
        and keeps it until ``max_loras`` others have run since (it evicts the least recently
        used). The adapters that pushed out."""
        recent = self.recent_adapters
        recent.pop(adapter, None)
        recent[adapter] = now
        evicted = []
        while len(recent) > max_loras:
            oldest = next(iter(recent))
            del recent[oldest]
            evicted.append(oldest)
        self._adapters = frozenset(recent)
        full = len(recent) >= max_loras
        self._adapter_lru_at = next(iter(recent.values())) if full else -math.inf
        return evicted

    def url(self, path: str) -> URL:
        """The replica's URL for a path, parsed once (URL parsing is a visible share of the
        per-request cost)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.endpoint.base_url + path)
        return url


@dataclass(frozen=True)
class Route:
    """A routing decision."""

    tier: RouterTier
    reason: str
    replica: ReplicaState  # unified, or the decode replica of a disaggregated tier
    prefill: ReplicaState | None = None
    prefix_match: float = 0.0
    score: float | None = None
    spilled_from: str | None = None
    # The LoRA adapter the request names (one the tier serves), None for the base model.
    adapter: str | None = None
    # Prompt blocks the prefilling replica (unified, or the P/D prefill one) is predicted not
    # to cache: the prefill work this request adds there until its first token.
    prefill_blocks: int = 0
    # The tier has a tokenizer but this prompt could not be tokenized (counted by the proxy).
    tokenizer_failed: bool = False
    # P/D: the decode replica holds all but a few of the prompt's tokens and computes them
    # itself, without a prefill hop (PD_LOCAL_PREFILL_TOKENS).
    local_prefill: bool = False
    # What the prefilling replica's pick knew of the prompt (a retry picks with it again).
    request: PickRequest = field(default_factory=PickRequest)

    @property
    def hashes(self) -> Sequence[int]:
        """The prompt's guessed-index block hashes."""
        return self.request.hashes

    @property
    def prefix_source(self) -> str:
        """What judged the prefilling replica's cache: "events" (its engine's KV events) or
        "guessed" (this router's record of what it sent there)."""
        return "events" if self.request.known else "guessed"

    @property
    def disaggregated(self) -> bool:
        return self.tier.mode is ServingMode.DISAGGREGATED

    @property
    def served_model(self) -> str:
        """The `model` the engines are asked for: the adapter, else the tier's model."""
        return self.adapter or self.tier.model

    def header(
        self,
        replica: ReplicaState | None = None,
        prefill: str | None = None,
        *,
        addresses: bool = False,
    ) -> str:
        """The ``x-fleetpilot-route`` value: tier, prefix-match, reason (and for a P/D tier
        whether the prefill hop ran). Replica addresses only with ``addresses``: they are the
        fleet's internal pod IPs, for debugging, not for every client to read."""
        parts = [f"tier={self.tier.name}"]
        if self.adapter is not None:
            parts.append(f"adapter={self.adapter}")
        if addresses:
            parts.append(f"replica={(replica or self.replica).id}")
        parts += [
            f"prefix-match={self.prefix_match:.2f}",
            f"prefix-source={self.prefix_source}",
            f"reason={self.reason}",
        ]
        if self.spilled_from is not None:
            parts.append(f"spilled-from={self.spilled_from}")
        if self.disaggregated:
            if self.local_prefill:
                parts.append("prefill=local")
            elif prefill is None:
                parts.append("prefill=none")
            else:
                parts.append(f"prefill={prefill if addresses else 'yes'}")
        if self.score is not None:
            parts.append(f"score={self.score:.2f}")
        return "; ".join(parts)


def adapter_of(tier: RouterTier, features: RequestFeatures) -> str | None:
    """The LoRA adapter a request for this tier names, or None (its base model)."""
    model = features.model
    return model if model is not None and model in tier.adapters else None


def serving_role(tier: RouterTier) -> RoleName:
    """The role whose replicas answer the client: decode in a disaggregated tier."""
    return RoleName.DECODE if tier.mode is ServingMode.DISAGGREGATED else RoleName.UNIFIED


class Router:
    """Tier and replica choice over the current endpoints and their state."""

    def __init__(
        self,
        config: RouterConfig,
        source: EndpointSource,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        weights: ComplexityWeights = DEFAULT_WEIGHTS,
        on_eject: Callable[[ReplicaState], None] | None = None,
        kv_index: KVIndex | None = None,
        kv_live: Callable[[str], bool] | None = None,
        on_replicas: Callable[[Mapping[str, ReplicaState]], None] | None = None,
        full_scan_max: int = FULL_SCAN_MAX,
    ) -> None:
        self.source = source
        # Groups of more replicas than this are picked among candidates (``_Large``).
        self.full_scan_max = full_scan_max
        self.rng = rng or random.Random()
        self.clock = clock
        self.weights = weights
        self.on_eject = on_eject
        self.kv_index = kv_index if kv_index is not None else KVIndex()
        # Whether an event stream is heard from now (the KV-events client's ``has_events``).
        self.kv_live: Callable[[str], bool] = kv_live or (lambda _stream: False)
        # Called with the new replica set whenever discovery changes it (the app follows it
        # with its KV-event subscriptions).
        self.on_replicas = on_replicas
        # Per tier name, the tokenizer the app loaded for it; absent: guess from text.
        self.tokenizers: dict[str, PromptKeys] = {}
        self.recent = RecentSends()
        self._replicas: dict[str, ReplicaState] = {}
        self._groups: dict[tuple[str, str], list[ReplicaState]] = {}
        self._seen_version = -1
        # The views of one decision (``views``); None outside ``decide``.
        self._views_memo: dict[tuple[str, str], list[ReplicaView]] | None = None
        # Per LoRA adapter, the replicas this router sent it to that still hold it, in order.
        self._adapter_holders: dict[str, dict[str, None]] = {}
        # Per group of over FULL_SCAN_MAX replicas: its ids, its consistent-hash ring, which
        # replica each KV stream is, and its tier state as last read (``_Large``).
        self._large: dict[tuple[str, str], _Large] = {}
        self.apply_config(config)

    # -- configuration and endpoints ---------------------------------------------------------
    def apply_config(self, config: RouterConfig) -> None:
        """Adopt a (re)loaded config; replica state of endpoints that remain is kept."""
        old = getattr(self, "config", None)
        self.config = config
        self.tiers = sorted(config.tiers, key=lambda t: t.up_to)
        self.tier_specs = [
            TierSpec(t.name, t.model, t.up_to, frozenset(t.adapters)) for t in self.tiers
        ]
        self.tier_index = {t.name: i for i, t in enumerate(self.tiers)}
        if old is None or old.prefix_index_blocks != config.prefix_index_blocks:
            self.prefix_index = PrefixIndex(config.prefix_index_blocks)
        if (
            old is None
            or old.ejection.failures != config.ejection.failures
            or old.ejection.window != config.ejection.window
        ):
            self.health = HealthTracker(
                config.ejection.failures, config.ejection.window.total_seconds()
            )
        self._health_filter = HealthFilter()
        self._capacity_filter = CapacityFilter(
            config.backpressure.max_waiting_per_replica, batch_only=config.flow is not None
        )
        # No headroom filter: the prefill-cost scorer weighs a replica's queue against what
        # its cache saves, where a filter dropped the caching replica at its first queued
        # request and, on evicting engines, spread every tenant over every cache.
        self._filters: list[Filter] = [
            self._health_filter,
            self._capacity_filter,
            AdapterHolderFilter(),
        ]
        self._affinity_scorers = self.affinity_scorers()
        # Decode replicas hold no prompt blocks sent by us: the KV arrives from prefill.
        load = LoadScorer(config.spillover.queue_threshold)
        self._load_scorers = [
            WeightedScorer(load, max(config.load_weight, 1e-6)),
            WeightedScorer(AdapterScorer(), config.adapter_weight),
        ]
        self._max_seqs: dict[tuple[str, str], int] = {
            (t.name, g.role): g.max_num_seqs for t in config.tiers for g in t.endpoints
        }
        self._block_sizes: dict[tuple[str, str], int] = {
            (t.name, g.role): g.block_size for t in config.tiers for g in t.endpoints
        }
        self._suspect_after_s = {
            t.name: config.ejection.suspect_fraction * self.first_byte_timeout_s(t)
            for t in config.tiers
        }
        self.source.configure(config)
        self._seen_version = -1
        self.sync()

    def affinity_scorers(self, block_cost: float = UNCACHED_BLOCK_COST) -> list[WeightedScorer]:
        """The scorers of unified and prefill picks as the config weighs them, an uncached
        prompt block priced at ``block_cost`` (benchmarks compare prices with
        ``use_policies(scorers=router.affinity_scorers(1.0))``)."""
        config = self.config
        return [
            WeightedScorer(
                PrefillCostScorer(self.prefix_index, block_cost), config.affinity.weight
            ),
            WeightedScorer(LoadScorer(config.spillover.queue_threshold), config.load_weight),
            WeightedScorer(AdapterScorer(), config.adapter_weight),
        ]

    def use_policies(
        self,
        *,
        filters: Sequence[Filter] | None = None,
        scorers: Sequence[WeightedScorer] | None = None,
    ) -> None:
        """Replace the plugins of unified and prefill replica picks with other instances
        (benchmarks compare policies this way). A config reload restores the defaults."""
        if filters is not None:
            self._filters = list(filters)
        if scorers is not None:
            self._affinity_scorers = list(scorers)

    def sync(self) -> None:
        """Re-read the source's endpoints if they changed."""
        version = self.source.version
        if version == self._seen_version:
            return
        self._seen_version = version
        replicas: dict[str, ReplicaState] = {}
        groups: dict[tuple[str, str], list[ReplicaState]] = {}
        for ep in self.source.endpoints():
            max_seqs = self._max_seqs.get((ep.tier, ep.role))
            if max_seqs is None or ep.id in replicas:
                continue  # a group the config no longer has, or a duplicate address
            state = self._replicas.get(ep.id)
            if state is None or state.endpoint != ep:
                state = ReplicaState(ep, max_seqs)
            state.max_num_seqs = max_seqs
            state.suspect_after_s = self._suspect_after_s.get(ep.tier, math.inf)
            replicas[ep.id] = state
            groups.setdefault((ep.tier, ep.role), []).append(state)
        self._replicas = replicas
        self._groups = groups
        self._large = {
            key: _Large(group) for key, group in groups.items() if len(group) > self.full_scan_max
        }
        self.prefix_index.retain(replicas)
        self.recent.retain(replicas)
        self.health.retain(set(replicas))
        if self.on_replicas is not None:
            self.on_replicas(replicas)

    def replicas(self) -> list[ReplicaState]:
        self.sync()
        return list(self._replicas.values())

    def replica(self, replica_id: str) -> ReplicaState | None:
        return self._replicas.get(replica_id)

    def group(self, tier: str, role: str) -> list[ReplicaState]:
        return self._groups.get((tier, role), [])

    # -- views -------------------------------------------------------------------------------
    def views(self, tier: str, role: str, now: float) -> list[ReplicaView]:
        """The group's replicas as the policies see them now; within one ``decide``, built
        once per group (the tier's state and the pick read the same views)."""
        memo = self._views_memo
        if memo is not None:
            found = memo.get((tier, role))
            if found is None:
                found = memo[(tier, role)] = self._build_views(tier, role, now)
            return found
        return self._build_views(tier, role, now)

    def _build_views(self, tier: str, role: str, now: float) -> list[ReplicaView]:
        return self._views_of(self._groups.get((tier, role), ()), now)

    def _views_of(self, states: Iterable[ReplicaState], now: float) -> list[ReplicaView]:
        stale = self.config.scrape.stale_after.total_seconds()
        health = self.health
        is_ejected = health.is_ejected
        return [
            r.view(now, stale, True, health.hangs(r.id)) if is_ejected(r.id)
            else r.view(now, stale, False)
            for r in states
        ]  # fmt: skip

    def tier_state(self, tier: RouterTier, now: float) -> TierState:
        large = self._large.get((tier.name, serving_role(tier)))
        if large is None:
            return self._tier_state(tier, now)
        if large.state is None or not 0.0 <= now - large.state_at <= TIER_STATE_MAX_AGE_S:
            large.state = self._tier_state(tier, now)
            large.state_at = now
        return large.state

    def _tier_state(self, tier: RouterTier, now: float) -> TierState:
        views = self.views(tier.name, serving_role(tier), now)
        if not views:
            return TierState(has_replicas=False, available=False, saturated=True)
        healthy = self._health_filter.filter(PickRequest(), views)
        open_ = self._capacity_filter.filter(PickRequest(), healthy)
        return TierState(
            # Every replica ejected as frozen: as good as none (503, or a cold-start hold,
            # until a /health probe readmits one), not "at capacity".
            has_replicas=bool(healthy),
            available=bool(open_),
            saturated=group_saturated(healthy, self.config.spillover.queue_threshold),
        )

    # -- decisions ---------------------------------------------------------------------------
    def prepare_keys(self, features: RequestFeatures) -> PreparedKeys | None:
        """The KV-index keys ``decide`` would compute for this request now - with its tier's
        tokenizer, at the block sizes of the groups whose events would judge it - looked up in
        the tokenizer's prefix cache but not yet computed; None when ``decide`` would compute
        none. A caller may compute them (``PreparedKeys.compute``, on any thread: the proxy does
        so in a worker when ``off_loop``) and hand them to ``decide``, which uses them if it
        chooses the same tier, and computes any block size they lack itself."""
        if features.payload is None or not self.tokenizers:
            return None
        self.sync()
        try:
            tier, _, _ = self._choose_tier(features, self.clock())
        except RouterError:
            return None  # decide raises it
        tokenizer = self.tokenizers.get(tier.name)
        if tokenizer is None:
            return None
        hashed = 0 < self.config.affinity.block_chars <= len(features.prompt_text)
        roles = (
            (RoleName.DECODE, RoleName.PREFILL)
            if tier.mode is ServingMode.DISAGGREGATED
            else (RoleName.UNIFIED,)
        )
        sizes = [b for role in roles if (b := self._events_block_size(tier, role, hashed))]
        if not sizes:
            return None
        keys = _KeysOnce(tokenizer, features, adapter_of(tier, features))
        return PreparedKeys(tier.name, keys, tuple(dict.fromkeys(sizes)))

    def decide(self, features: RequestFeatures, prepared: PreparedKeys | None = None) -> Route:
        """Tier, then replica(s). ``prepared``: the request's keys from ``prepare_keys``, used
        if this decision chooses the tier they were prepared for (a decision without them
        computes the keys it needs itself, as one with them does for another tier).

        Raises ``UnknownModelError``/``InvalidRequestError`` for a bad target,
        ``OverloadedError`` (429) when every eligible replica is full, and
        ``NoReplicaError`` (503) when no eligible tier has a Ready replica.
        """
        self._views_memo = {}
        try:
            return self._decide(features, prepared)
        finally:
            self._views_memo = None

    def _decide(self, features: RequestFeatures, prepared: PreparedKeys | None) -> Route:
        self.sync()
        now = self.clock()
        tier, choice, target = self._choose_tier(features, now)
        spilled = self.tiers[choice.spilled_from].name if choice.spilled_from is not None else None
        adapter = adapter_of(tier, features)
        allowed = features.allowed_adapters
        if adapter is not None and allowed is not None and adapter not in allowed:
            raise PermissionDeniedError(
                f"this API key may not use adapter {adapter!r}", reason="adapter_not_allowed"
            )
        hashes: list[int] = []
        if self.config.affinity.weight > 0:
            # An adapter's KV differs from the base model's for the same prompt: as vLLM's
            # block hashes do, the guessed ones name what computed them.
            hashes = block_hashes(
                features.prompt_text, adapter or tier.model, self.config.affinity.block_chars
            )
        if prepared is not None and prepared.tier == tier.name:
            keys = prepared.keys
        else:
            keys = _KeysOnce(self.tokenizers.get(tier.name), features, adapter)
        if tier.mode is ServingMode.DISAGGREGATED:
            # The decode role's events count too: a decode replica that already holds the
            # prompt's blocks pulls fewer of them from the prefill replica.
            decode_request, decode_keys = self._pick_request(
                tier, RoleName.DECODE, hashes, keys, now
            )
            decode_request = self._with_adapter(tier, RoleName.DECODE, decode_request, adapter)
            decode_scorers = self._affinity_scorers if decode_request.known else self._load_scorers
            decode = self._pick(tier, RoleName.DECODE, decode_request, now, decode_scorers)
            if decode is None:
                raise self._none_open(tier, "no decode replica available")
            self.recent.record(decode.replica.id, decode_keys, now)
            self._note_adapter(tier, decode.replica.id, adapter, now)
            local = self._local_prefill(tier, decode_request, decode.replica.id, decode_keys, keys)
            if local is not None and local[0] <= PD_LOCAL_PREFILL_TOKENS:
                return Route(
                    tier=tier,
                    reason=choice.reason,
                    replica=self._replicas[decode.replica.id],
                    prefix_match=decode_request.cached.get(decode.replica.id, 0.0),
                    score=target.score,
                    spilled_from=spilled,
                    adapter=adapter,
                    prefill_blocks=local[1],
                    tokenizer_failed=keys.failed,
                    request=decode_request,
                    local_prefill=True,
                )
            request, chained = self._pick_request(tier, RoleName.PREFILL, hashes, keys, now)
            request = self._with_adapter(tier, RoleName.PREFILL, request, adapter)
            # Optional: with no sound prefill replica the decode replica prefills itself.
            prefill = self._pick(
                tier, RoleName.PREFILL, replace(request, optional=True), now, self._affinity_scorers
            )
            prefill_state = None
            matched = 0.0
            if prefill is not None:
                prefill_state = self._replicas[prefill.replica.id]
                matched = matched_blocks(self.prefix_index, request, prefill_state.id)
                self.prefix_index.record(prefill_state.id, hashes)
                self.recent.record(prefill_state.id, chained, now)
                self._note_adapter(tier, prefill_state.id, adapter, now)
            return Route(
                tier=tier,
                reason=choice.reason,
                replica=self._replicas[decode.replica.id],
                prefill=prefill_state,
                prefix_match=matched / len(hashes) if hashes else 0.0,
                score=target.score,
                spilled_from=spilled,
                adapter=adapter,
                prefill_blocks=round(len(hashes) - matched),
                tokenizer_failed=keys.failed,
                request=request,
            )
        request, chained = self._pick_request(tier, RoleName.UNIFIED, hashes, keys, now)
        request = self._with_adapter(tier, RoleName.UNIFIED, request, adapter)
        chosen = self._pick(tier, RoleName.UNIFIED, request, now, self._affinity_scorers)
        if chosen is None:
            raise self._none_open(tier, "no replica available")
        state = self._replicas[chosen.replica.id]
        matched = matched_blocks(self.prefix_index, request, state.id)
        self.prefix_index.record(state.id, hashes)
        self.recent.record(state.id, chained, now)
        self._note_adapter(tier, state.id, adapter, now)
        return Route(
            tier=tier,
            reason=choice.reason,
            replica=state,
            prefix_match=matched / len(hashes) if hashes else 0.0,
            score=target.score,
            spilled_from=spilled,
            adapter=adapter,
            prefill_blocks=round(len(hashes) - matched),
            tokenizer_failed=keys.failed,
            request=request,
        )

    def _note_adapter(
        self, tier: RouterTier, replica_id: str, adapter: str | None, now: float
    ) -> None:
        if adapter is None:
            return
        evicted = self._replicas[replica_id].note_adapter(adapter, tier.max_loras, now)
        self._adapter_holders.setdefault(adapter, {})[replica_id] = None
        for gone in evicted:
            holders = self._adapter_holders.get(gone)
            if holders is not None:
                holders.pop(replica_id, None)

    def _with_adapter(
        self, tier: RouterTier, role: RoleName, request: PickRequest, adapter: str | None
    ) -> PickRequest:
        """The pick request naming the request's adapter, for the adapter scorer; in a group
        too large to score every replica, its candidates gain the replicas this router last
        sent the adapter to and the adapter's home on the ring (where it goes when nobody
        holds it), so the pick can find them."""
        if adapter is None:
            return request
        candidates = request.candidates
        large = self._large.get((tier.name, role))
        if candidates is not None and large is not None:
            held = self._adapter_holders.get(adapter, {})
            holders = [rid for rid in reversed(held) if rid in large.ids][:HOLDER_CANDIDATES]
            home = large.ring.successors(adapter.encode("utf-8", "surrogatepass"), HOME_CANDIDATES)
            candidates = tuple(dict.fromkeys([*candidates, *holders, *home]))
        return replace(request, adapter=adapter, candidates=candidates)

    def waiting_tier(self, features: RequestFeatures) -> RouterTier:
        """The tier a request waits for when every replica in its reach is saturated: its
        base tier, within what its tenant may use."""
        target = resolve_target(features, self.tier_specs, self.config.service, self.weights)
        if features.allowed_tiers is not None:
            closed = TierState(has_replicas=False, available=False, saturated=True)
            target, _ = self._within(target, features.allowed_tiers, lambda _: closed)
        return self.tiers[target.index]

    def _choose_tier(
        self, features: RequestFeatures, now: float
    ) -> tuple[RouterTier, TierChoice, Target]:
        """The tier (and why) for this request now; raises as ``decide`` does."""
        target = resolve_target(features, self.tier_specs, self.config.service, self.weights)

        def state(i: int) -> TierState:
            return self.tier_state(self.tiers[i], now)

        allowed = features.allowed_tiers
        states: Callable[[int], TierState] = state
        if allowed is not None:
            target, states = self._within(target, allowed, state)
        choice = choose_tier(target, len(self.tiers), states, self.config.spillover.enabled)
        if choice.index is None:
            if choice.reason == "saturated":
                raise self._overloaded()
            wanted = self.tiers[target.index]
            raise NoReplicaError(
                "no ready replica can serve this request",
                tier=wanted.name,
                roles=tuple(group.role for group in wanted.endpoints),
            )
        return self.tiers[choice.index], choice, target

    def _within(
        self, target: Target, allowed: frozenset[str], state: Callable[[int], TierState]
    ) -> tuple[Target, Callable[[int], TierState]]:
        """The target and tier states for a tenant that may use only the ``allowed`` tiers:
        a tier it named is used or refused (403); the router's own choice moves to the
        nearest allowed tier, the next one up first (as a spill would), and never spills to
        one it may not use."""
        permitted = [i for i, tier in enumerate(self.tiers) if tier.name in allowed]
        wanted = self.tiers[target.index].name
        if target.pinned and target.index not in permitted:
            raise PermissionDeniedError(
                f"this API key may not use tier {wanted!r}", reason="tier_not_allowed"
            )
        if not permitted:
            raise PermissionDeniedError(
                "this API key may use no tier of this service", reason="tier_not_allowed"
            )
        if target.index not in permitted:
            above = [i for i in permitted if i > target.index]
            target = replace(target, index=above[0] if above else permitted[-1])
        closed = TierState(has_replicas=False, available=False, saturated=True)
        return target, lambda i: state(i) if i in permitted else closed

    def _none_open(self, tier: RouterTier, message: str) -> RouterError:
        """The error for a pick that found no replica after ``tier_state`` said one was open:
        they filled in between (a race, or the tier state of a large group, read up to
        ``TIER_STATE_MAX_AGE_S`` ago), so the tier is at capacity - retry later."""
        if self._large.get((tier.name, serving_role(tier))) is None:
            return UnavailableError(message, reason="no_ready_replicas")
        return self._overloaded()

    def _overloaded(self) -> OverloadedError:
        """429: every replica that could serve the request is at capacity."""
        retry = self.config.backpressure.retry_after.total_seconds()
        return OverloadedError(
            "every replica that could serve this request is at capacity; retry later",
            reason="overloaded",
            headers={"Retry-After": str(max(1, round(retry)))},
        )

    def _events_block_size(self, tier: RouterTier, role: RoleName, hashed: bool) -> int | None:
        """The block size at which the prompt's KV-index keys are matched against a group's
        events, or None when its events do not judge the prompt: no replicas, no full block of
        prompt text (``hashed`` false) or no affinity, or a replica without live events."""
        group = self._groups.get((tier.name, role), ())
        if not group or not hashed or self.config.affinity.weight <= 0:
            return None
        large = self._large.get((tier.name, role))
        if large is None:
            return self._group_block_size(tier, role, group)
        # Every stream's liveness, read again at most every TIER_STATE_MAX_AGE_S: a stream
        # that falls silent is noticed after seconds (kv_events_client), not milliseconds.
        now = self.clock()
        if not 0.0 <= now - large.block_size_at <= TIER_STATE_MAX_AGE_S:
            large.block_size = self._group_block_size(tier, role, group)
            large.block_size_at = now
        return large.block_size

    def _group_block_size(
        self, tier: RouterTier, role: RoleName, group: Sequence[ReplicaState]
    ) -> int | None:
        streams = [s for r in group for s in r.kv_streams]
        if not all(r.kv_streams for r in group) or not all(map(self.kv_live, streams)):
            return None
        # The engines' block size once they reported one, the planned one before.
        return next(
            (b for s in streams if (b := self.kv_index.block_size(s)) is not None),
            self._block_sizes[(tier.name, role)],
        )

    def _local_prefill(
        self,
        tier: RouterTier,
        request: PickRequest,
        replica: str,
        chained: Sequence[bytes],
        keys: _KeysOnce,
    ) -> tuple[int, int] | None:
        """The prompt tokens, and blocks, a decode replica would compute itself if sent the
        request without a prefill hop; ``request`` and ``chained`` are the decode pick's.
        Known only when its group's events judged the prompt and its keys cover the whole
        prompt."""
        if replica not in request.known:
            return None
        block_size = self._events_block_size(tier, RoleName.DECODE, bool(request.hashes))
        total = keys.prompt_tokens(chained)
        if block_size is None or total is None:
            return None
        held = round(request.cached.get(replica, 0.0) * len(chained))
        tokens = total - held * block_size
        return tokens, -(-tokens // block_size)

    def _pick_request(
        self, tier: RouterTier, role: RoleName, hashes: list[int], keys: _KeysOnce, now: float
    ) -> tuple[PickRequest, list[bytes]]:
        """What the pick knows of the prompt for one role's replicas, and the prompt's KV-index
        keys (empty when not computed): the KV index's matches - or, where longer, what this
        router sent there in the last moments, which the events cannot have reported yet -
        when every replica of the group publishes live events and the prompt could be
        tokenized; else only the guessed index's hashes."""
        block_size = self._events_block_size(tier, role, bool(hashes))
        if block_size is None:
            return PickRequest(hashes), []
        group = self._groups[(tier.name, role)]
        chained = keys.get(block_size)
        if chained is None:
            return PickRequest(hashes), []
        large = self._large.get((tier.name, role))
        known = large.ids if large is not None else frozenset(r.id for r in group)
        if not chained:
            return PickRequest(hashes, known), []
        held = self.kv_index.match_keys(chained)
        if large is None:
            depths = {}
            for r in group:
                blocks = max((held.get(s, 0) for s in r.kv_streams), default=0)
                blocks = max(blocks, self.recent.matched(r.id, chained, now))
                if blocks:
                    depths[r.id] = blocks
        else:
            depths = self._large_depths(large, held, chained, now)
        # The KV-index keys are content hashes, the same in every router replica (the guessed
        # index's are salted per process), so only here can a tie be broken alike everywhere.
        deepest = max(depths.values(), default=0)
        tie_key = chained[min(deepest + TIE_KEY_LOOKAHEAD_BLOCKS, len(chained) - 1)]
        candidates = None
        if large is not None:
            holders = holder_candidates(depths, self._demand)
            home = large.ring.successors(tie_key, HOME_CANDIDATES)
            candidates = tuple(dict.fromkeys([*holders, *home]))
        cached = {}
        pressure = {}
        for rid in candidates if candidates is not None else (r.id for r in group):
            blocks = depths.get(rid, 0)
            if blocks:
                cached[rid] = blocks / len(chained)
            evicting = max(map(self.kv_index.eviction_pressure, self._replicas[rid].kv_streams))
            if evicting:
                pressure[rid] = evicting
        return PickRequest(hashes, known, cached, pressure, tie_key, candidates), chained

    def _large_depths(
        self, large: _Large, held: Mapping[str, int], chained: list[bytes], now: float
    ) -> dict[str, int]:
        """Per replica of a large group that holds some of the prompt, its leading blocks held
        (by the KV index's ``held`` per stream, or by what this router just sent there): read
        from the holders, not from every replica."""
        depths: dict[str, int] = {}
        owner = large.stream_owner
        for stream, blocks in held.items():
            rid = owner.get(stream)
            if rid is not None and blocks > depths.get(rid, 0):
                depths[rid] = blocks
        recent = self.recent
        for rid in recent.holders(chained, now, above=max(depths.values(), default=0)):
            if rid in large.ids:
                blocks = recent.matched(rid, chained, now)
                if blocks > depths.get(rid, 0):
                    depths[rid] = blocks
        return depths

    def _demand(self, replica_id: str) -> float:
        """A replica's requests (``ReplicaView.demand``, scraped gauges however old): how the
        holders of a prompt in a large group are ranked before their views are made."""
        state = self._replicas[replica_id]
        m = state.metrics
        return max(float(state.in_flight), m.running + m.waiting if m is not None else 0.0)

    def _pick(
        self,
        tier: RouterTier,
        role: RoleName,
        request: PickRequest,
        now: float,
        scorers: list[WeightedScorer],
        exclude: frozenset[str] = frozenset(),
    ) -> Pick | None:
        if request.candidates is not None:
            chosen = self._pick_candidates(tier, role, request, now, scorers, exclude)
            if chosen is not None:
                return chosen
        views = self.views(tier.name, role, now)
        if exclude:
            views = [v for v in views if v.id not in exclude]
        return pick(request, views, self._filters, scorers, self.rng)

    def _pick_candidates(
        self,
        tier: RouterTier,
        role: RoleName,
        request: PickRequest,
        now: float,
        scorers: list[WeightedScorer],
        exclude: frozenset[str],
    ) -> Pick | None:
        """The pick among the request's candidates - and, when none of them has room for it
        at once, a random sample of the rest of the group too; ``None`` when none passes the
        filters (the caller then scans the whole group)."""
        assert request.candidates is not None
        large = self._large.get((tier.name, role))
        if large is None:  # the group shrank since the request was made, or another role's
            return None
        ids = [rid for rid in request.candidates if rid in large.ids and rid not in exclude]
        replicas = self._replicas
        views = self._views_of((replicas[rid] for rid in ids), now)
        if not any(has_headroom(v) for v in views):
            drawn = sample(large.order, [*ids, *exclude], SAMPLED_CANDIDATES, self.rng)
            views += self._views_of((replicas[rid] for rid in drawn), now)
        if not views:
            return None
        return pick(request, views, self._filters, scorers, self.rng)

    def alternative(self, route: Route, exclude: set[str]) -> ReplicaState | None:
        """Another replica of the route's serving group for a retry, or ``None``."""
        self.sync()
        role = serving_role(route.tier)
        scorers = self._load_scorers if route.disaggregated else self._affinity_scorers
        chosen = self._pick(
            route.tier, role, route.request, self.clock(), scorers, frozenset(exclude)
        )
        if chosen is None:
            return None
        state = self._replicas[chosen.replica.id]
        if not route.disaggregated:
            self.prefix_index.record(state.id, route.hashes)
        self._note_adapter(route.tier, state.id, route.adapter, self.clock())
        return state

    def batch_slots(self, tier_name: str) -> int:
        """The sequences the tier's serving replicas in rotation run at once."""
        self.sync()
        tier = self.tiers[self.tier_index[tier_name]]
        return sum(
            r.max_num_seqs
            for r in self.group(tier.name, serving_role(tier))
            if not self.health.is_ejected(r.id)
        )

    def first_byte_timeout_s(self, tier: RouterTier) -> float:
        """The tier's time-to-first-byte budget per upstream attempt, in seconds."""
        budget = tier.first_byte_timeout or self.config.first_byte_timeout
        return budget.total_seconds()

    # -- outcomes ----------------------------------------------------------------------------
    def record_failure(self, replica: ReplicaState, *, hung: bool = False) -> bool:
        """Count a failure (``hung``: a wait that ran out, not a quick refusal); True (and
        ``on_eject`` called) when it ejects the replica."""
        ejected = self.health.record_failure(replica.id, self.clock(), hung=hung)
        if ejected:
            log.warning(
                "replica ejected",
                extra={"replica": replica.id, "tier": replica.endpoint.tier},
            )
            if self.on_eject is not None:
                self.on_eject(replica)
        return ejected

    def record_success(self, replica: ReplicaState) -> None:
        replica.heard_from()
        self.health.record_success(replica.id)

    def has_sound_peer(self, route: Route, tried: Iterable[str]) -> bool:
        """Whether a retry of the route would find a replica of its serving group, none of
        ``tried``, that is neither ejected nor suspect and has room: where a request waiting on
        a suspect replica can go instead. The pick ``alternative`` would make, without its
        bookkeeping."""
        self.sync()
        role = serving_role(route.tier)
        scorers = self._load_scorers if route.disaggregated else self._affinity_scorers
        chosen = self._pick(
            route.tier, role, route.request, self.clock(), scorers, frozenset(tried)
        )
        return chosen is not None and not chosen.replica.ejected and not chosen.replica.suspect

    def record_adapter_missing(self, replica: ReplicaState, adapter: str) -> None:
        """The replica answered a request for ``adapter`` with 404: it has not loaded it yet
        (dynamic LoRA). Not a failure - it answered, and serves everything else - but for
        ``ADAPTER_MISSING_S`` it scores last for the adapter and is no holder of it."""
        replica.note_adapter_missing(adapter, self.clock())
        holders = self._adapter_holders.get(adapter)
        if holders is not None:
            holders.pop(replica.id, None)
        log.info(
            "replica lacks adapter",
            extra={"replica": replica.id, "tier": replica.endpoint.tier, "adapter": adapter},
        )

    def record_adapter_served(self, replica: ReplicaState, adapter: str) -> None:
        """The replica answered a request for ``adapter``: any mark that it lacks it ends."""
        if replica.missing_adapters:
            replica.note_adapter_served(adapter)

    def readmit(self, replica_id: str) -> bool:
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.heard_from()  # its /health answered
        readmitted = self.health.readmit(replica_id)
        if readmitted:
            log.info("replica readmitted", extra={"replica": replica_id})
        return readmitted


class _Large:
    """What a pick needs of a group of over ``FULL_SCAN_MAX`` replicas, kept from one
    discovery change to the next."""

    def __init__(self, group: Sequence[ReplicaState]) -> None:
        self.order = [r.id for r in group]
        self.ids = frozenset(self.order)
        self.ring = HashRing(self.order)
        self.stream_owner = {s: r.id for r in group for s in r.kv_streams}
        self.state: TierState | None = None
        self.state_at = -math.inf
        self.block_size: int | None = None
        self.block_size_at = -math.inf


@dataclass(frozen=True)
class PreparedKeys:
    """A request's KV-index keys for one tier at the block sizes ``decide`` would match them at
    (``Router.prepare_keys``), to compute ahead of ``decide`` with ``compute``."""

    tier: str
    keys: _KeysOnce
    block_sizes: tuple[int, ...]

    @property
    def off_loop(self) -> bool:
        """Whether computing them costs more than an event loop should stall for: the
        tokenizer would encode over ``OFF_LOOP_TOKENIZE_CHARS`` characters (or, for a request
        too long to look up cheaply, carries that many)."""
        return self.keys.pending_chars() > OFF_LOOP_TOKENIZE_CHARS

    def compute(self) -> None:
        """Compute the keys at every block size, on any thread: the tokenizer is thread-safe,
        and ``decide`` reads them only after this returned."""
        for block_size in self.block_sizes:
            self.keys.get(block_size)


class _KeysOnce:
    """A request's KV-index keys, computed at most once per block size and only when some
    group's events could use them (tokenizing costs more than the rest of a decision)."""

    def __init__(
        self, tokenizer: PromptKeys | None, features: RequestFeatures, adapter: str | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.features = features
        self.adapter = adapter  # the engines key an adapter's blocks by its name
        self.failed = False
        self._plan: PromptPlan | None = None
        self._keys: dict[int, list[bytes] | None] = {}

    def _planned(self) -> PromptPlan | None:
        """The tokenizer's plan of the request (made once), or None where there is none."""
        if self._plan is None and not self.failed:
            if self.tokenizer is None or self.features.payload is None:
                return None
            try:
                self._plan = self.tokenizer.plan(self.features.kind, self.features.payload)
            except TokenizerError:
                self.failed = True
        return self._plan

    def pending_chars(self) -> int:
        """The characters tokenizing the request would encode (0 when it will not be)."""
        plan = self._planned()
        return 0 if plan is None else plan.pending_chars

    def prompt_tokens(self, keys: Sequence[bytes]) -> int | None:
        """The prompt's length in tokens, when ``keys`` (as :meth:`get` gave them) cover the
        whole prompt; None for a head cut at the tokenizer's length cap or at the KV index's
        ``MAX_MATCH_BLOCKS``."""
        if self._plan is None or len(keys) >= MAX_MATCH_BLOCKS:
            return None
        return self._plan.prompt_tokens

    def get(self, block_size: int) -> list[bytes] | None:
        """The keys, or None without a tokenizer or for a prompt it cannot tokenize."""
        if block_size in self._keys:
            return self._keys[block_size]
        keys: list[bytes] | None = None
        plan = self._planned()
        if plan is not None:
            try:
                keys = plan.keys(block_size, self.adapter)
            except TokenizerError:
                self.failed = True
        self._keys[block_size] = keys
        return keys
