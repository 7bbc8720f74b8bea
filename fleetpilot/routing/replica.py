"""What the router tracks about one replica between requests (``ReplicaState``): its load
counts, scraped metrics, suspicion, LoRA adapters, and the view the policies read. No I/O.

The proxy's upstream attempts are the one writer of a replica's request counts (``in_flight``,
``pending_prefill``); the router's decisions only read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from yarl import URL

from fleetpilot.routing.endpoints import Endpoint
from fleetpilot.routing.policies.load import EngineMetrics, make_view
from fleetpilot.routing.policies.suspicion import FirstByteWaits, is_suspect
from fleetpilot.routing.policies.types import ReplicaView

# Where the traffic went lately (``ReplicaState.recent_sends``): the requests sent in this
# window and the one before, so 10-20 s of them - several at a few requests a second, and a
# tenant's burst shows within seconds.
RECENT_WINDOW_S = 10.0

# How long a replica that answered a request for a LoRA adapter with 404 (vLLM's "model does
# not exist") is held not to have it: scored last for it and no holder of it. With dynamic
# LoRA the operator loads a tier's adapters into an engine only after its pod turns Ready
# (``/v1/load_lora_adapter``), so a new or restarted replica lacks them for the second or so
# a load from a volume takes (longer for a Hub download, or until the operator's next sync for
# an engine restarted in place). Ten scrape intervals (1 s by default): a scrape that shows
# the adapter running there, or an answer naming it, ends the mark sooner; once it runs out
# an unloaded replica costs one more 404, which is retried elsewhere.
ADAPTER_MISSING_S = 10.0


@dataclass(eq=False)
class ReplicaState:
    """What the router tracks about one replica between requests."""

    endpoint: Endpoint
    max_num_seqs: int
    in_flight: int = 0
    pending_prefill: float = 0.0  # see ReplicaView.pending_prefill
    # The same counts of the other router replicas, as of their last exchange
    # (``routing.peers``: its one writer); 0 without peers.
    peer_in_flight: int = 0
    peer_pending: float = 0.0
    peer_recent: float = 0.0
    # Prefills this router sent here in the current window of RECENT_WINDOW_S and the one
    # before (``note_send``).
    _sends_now: int = field(default=0, init=False, repr=False)
    _sends_before: int = field(default=0, init=False, repr=False)
    _window: int = field(default=0, init=False, repr=False)
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

    def note_send(self, now: float) -> None:
        """This router sent the replica a request whose prompt it computes, at ``now``."""
        self._roll(now)
        self._sends_now += 1

    def recent_sends(self, now: float, *, own: bool = False) -> float:
        """Prefills sent here in the last one to two ``RECENT_WINDOW_S``: by this router and
        (unless ``own``) by its peers as of their last exchange."""
        self._roll(now)
        mine = self._sends_now + self._sends_before
        return mine if own else mine + self.peer_recent

    def _roll(self, now: float) -> None:
        window = int(now // RECENT_WINDOW_S)
        if window != self._window:
            self._sends_before = self._sends_now if window == self._window + 1 else 0
            self._sends_now = 0
            self._window = window

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
        in_flight = self.in_flight + self.peer_in_flight
        pending = self.pending_prefill + self.peer_pending
        recent = self.recent_sends(now)
        made_of = (
            recent,
            in_flight,
            pending,
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
                in_flight,
                metrics,
                self.scraped_at,
                now,
                stale_after_s,
                ejected,
                pending,
                adapters,
                self._adapter_lru_at,
                missing,
                hangs=hangs,
                suspect=suspect,
                recent_sends=recent,
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
