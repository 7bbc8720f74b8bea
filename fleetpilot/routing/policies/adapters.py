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
