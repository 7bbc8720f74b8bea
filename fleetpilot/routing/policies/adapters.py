"""LoRA adapter affinity: prefer a replica that has the request's adapter loaded. Purely
computational.

An engine runs at most ``--max-loras`` adapters at once; a request for another one waits until a
slot frees (a running request of some loaded adapter must finish) and then pays for moving the
adapter in. A replica whose engine runs the adapter already - by its scraped
``vllm:lora_requests_info``, or because this router sent it requests for it lately - serves at
once; one that answered a request for it with 404 (dynamic LoRA: the operator loads adapters
into an engine only after its pod is ready) has not loaded it yet and comes last. The score
says only that; the load scorer and the headroom filter spread a hot adapter over more
replicas as soon as its holders have no room.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetpilot.routing.policies.load import has_headroom
from fleetpilot.routing.policies.picker import rendezvous_weight
from fleetpilot.routing.policies.types import PickRequest, ReplicaView

# A replica without the adapter scores at most these: for evicting the adapter least likely
# to be asked for again (the least recently sent), and for its place in the adapter's home
# order.
EVICT_SCORE = 0.5
HOME_SCORE = 0.1


class AdapterScorer:
    """Scorer: 1 for a replica that has the request's adapter, 0 for one that lately answered
    it does not (``ReplicaView.missing_adapters``: dynamic LoRA loads adapters into an engine
    only after its pod is ready), so it is picked last until it loads it. Among the others,
    loading it evicts an adapter (the engine's least recently used) unless a slot is free: the
    replica whose evicted adapter was sent longest ago (a free slot first) scores up to
    ``EVICT_SCORE``, the one whose is the freshest nothing - an eviction there would be paid
    for again by the next request for it. Each also scores up to ``HOME_SCORE`` by the
    adapter's home order (rendezvous hashing of its name: the same in every router replica),
    so an adapter nobody holds goes where its earlier requests went. Every one of them scores
    above 0. Nothing for a request of the base model (every replica has it)."""

    name = "adapter"

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        adapter = request.adapter
        if adapter is None:
            return {}
        key = adapter.encode("utf-8", "surrogatepass")
        scores: dict[str, float] = {}
        cold: list[ReplicaView] = []
        for v in replicas:
            if adapter in v.missing_adapters:
                scores[v.id] = 0.0
            elif adapter in v.adapters:
                scores[v.id] = 1.0
            else:
                cold.append(v)
        home = sorted(cold, key=lambda v: rendezvous_weight(key, v.id), reverse=True)
        stale = sorted(cold, key=lambda v: v.adapter_lru_at)
        for rank, v in enumerate(home):
            scores[v.id] = HOME_SCORE * (1.0 - rank / len(cold))
        for rank, v in enumerate(stale):
            scores[v.id] += EVICT_SCORE * (1.0 - rank / len(cold))
        return scores


# How far above the group's mean in-flight a replica holding the adapter may go before the
# adapter spreads to another replica (consistent hashing with bounded loads' factor, over the
# replicas that hold it instead of fixed homes), plus a few requests: at small totals the
# bare bound is one request, which spread a hot adapter at its second concurrent request.
HOLDER_LOAD_FACTOR = 1.5
HOLDER_SLACK = 2


class AdapterHolderFilter:
    """Filter: a request for an adapter goes to a replica that holds it while one has room -
    a free batch slot, no queue (``has_headroom``) and at most ``factor`` times the group's
    mean in-flight count plus ``HOLDER_SLACK`` - and only then to another, which loads it
    (the adapter scorer picks which, by what it would evict). The load and prefix scorers
    alone traded a swap for a slightly shorter batch: a hot adapter ended up on most replicas,
    each copy evicting some colder adapter that was then loaded again. The bound is what
    spreads one hot adapter: its holders take at most ``factor`` times their share."""

    name = "adapter-holders"

    def __init__(self, factor: float = HOLDER_LOAD_FACTOR) -> None:
        if factor < 1.0:
            raise ValueError("the holder load factor must be at least 1")
        self.factor = factor

    def filter(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        adapter = request.adapter
        if adapter is None:
            return list(replicas)
        total = sum(v.in_flight for v in replicas)
        n = len(replicas)
        roomy = [
            v
            for v in replicas
            if adapter in v.adapters
            and adapter not in v.missing_adapters
            and has_headroom(v)
            and v.in_flight + 1 <= self.factor * (total + 1) / n + HOLDER_SLACK
        ]
        return roomy if roomy else list(replicas)
