"""The plain data the routing policies exchange, and the plugin interfaces. Purely
computational."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica as the policies see it at one instant."""

    id: str
    max_num_seqs: int
    # Requests the router replicas have in flight there: this one's exact, its peers' as of
    # their last exchange (``routing.peers``).
    in_flight: int = 0
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    ejected: bool = False
    # Ejected, and some failure that ejected it was a wait that ran out (a frozen replica),
    # not a quick refusal: trying it again costs a whole first-byte budget.
    hangs: bool = False
    # Passed over for new requests before any ejection: a request has waited a while for its
    # first byte there and its last scrape or probe went unanswered (``policies.suspicion``).
    suspect: bool = False
    # Prompt blocks the router replicas have sent to the replica that have no first token
    # yet: the prefill work queued ahead of a new request there (this router's exact, its
    # peers' as of their last exchange).
    pending_prefill: float = 0.0
    # Requests this router sent the replica to prefill lately (``ReplicaState.recent_sends``):
    # where the traffic goes, so where the requests that will queue behind a long prefill
    # come from.
    recent_sends: float = 0.0
    # LoRA adapters the replica likely has loaded: its engine's running and waiting requests'
    # (scraped), and the last few this router sent there (``ReplicaState.note_adapter``).
    adapters: frozenset[str] = frozenset()
    # When the adapter a new one would evict here was last sent (this router's sends; -inf:
    # fewer than --max-loras adapters sent, a slot is free).
    adapter_lru_at: float = -math.inf
    # LoRA adapters the replica lately answered it does not have (a 404 naming the adapter:
    # dynamic LoRA loads adapters into an engine after its pod is ready), none of them in
    # ``adapters`` (``replica.ADAPTER_MISSING_S``).
    missing_adapters: frozenset[str] = frozenset()
    # Derived once, at construction: every filter and scorer of a pick reads them, several
    # times a replica, and a pick over hundreds of replicas spent a fifth of its time
    # recomputing them (``bench/simulate_speed.py``).
    # Requests on the replica: our own in-flight, or the engine's count if it sees more.
    demand: float = field(init=False)
    # Requests waiting for a batch slot, by the engine's count or by ours.
    queued: float = field(init=False)
    # Requests a new one would wait behind before it runs: the queue, or one when the batch is
    # full (it waits for a running request to finish).
    ahead: float = field(init=False)

    def __post_init__(self) -> None:
        demand = max(float(self.in_flight), self.running + self.waiting)
        queued = max(self.waiting, float(self.in_flight - self.max_num_seqs))
        setter = object.__setattr__  # frozen
        setter(self, "demand", demand)
        setter(self, "queued", queued)
        setter(self, "ahead", max(queued, demand + 1.0 - self.max_num_seqs, 0.0))


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What the replica plugins know about the request being placed."""

    hashes: Sequence[int] = field(default_factory=tuple)
    # Replicas whose engines' KV events speak for them (the router tokenized the prompt and
    # matched it in its KV index), each with the fraction of the prompt's blocks it holds
    # (absent from ``cached``: none). Every other replica is judged by the guessed index on
    # ``hashes``.
    known: frozenset[str] = frozenset()
    cached: Mapping[str, float] = field(default_factory=dict)
    # Of ``cached``, the fraction of the prompt's blocks each replica holds in host memory
    # only (KV offloading): the run after its device prefix, which its engine copies back
    # instead of computing (absent: none; ``KVIndex.match_tiers``).
    host: Mapping[str, float] = field(default_factory=dict)
    # Of the known replicas, how hard each engine is evicting now, in [0, 1]
    # (``KVIndex.eviction_pressure``; absent: not evicting, or not known).
    pressure: Mapping[str, float] = field(default_factory=dict)
    # Breaks ties alike in every router replica (``picker.pick``): the KV-index key of a
    # prompt block a few past the deepest one any replica holds
    # (``affinity.TIE_KEY_LOOKAHEAD_BLOCKS``), so a cold tenant's requests land together and the
    # users of one shared prefix spread by their own next blocks. ``None``: break at random.
    tie_key: bytes | None = None
    # The replicas worth scoring in a group too large to score every one
    # (``policies.candidates``); ``None``: every replica of the group.
    candidates: tuple[str, ...] | None = None
    # The LoRA adapter the request names (None: the base model).
    adapter: str | None = None
    # The request can do without this group (a P/D prefill hop: the decode replica computes
    # the prompt itself), so no unsound replica of it is worth a try (``HealthFilter``).
    optional: bool = False


class Filter(Protocol):
    """Drops replicas that must not take the request."""

    name: str

    def filter(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        """The replicas that pass, in their input order."""
        ...


class Scorer(Protocol):
    """Scores each replica in [0, 1]; higher is better."""

    name: str

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        """A score in [0, 1] per replica id."""
        ...
