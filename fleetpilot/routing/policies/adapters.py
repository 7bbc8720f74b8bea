"""LoRA adapter affinity: prefer a replica that has the request's adapter loaded. Purely
computational.

An engine runs at most ``--max-loras`` adapters at once; a request for another one waits until a
slot frees (a running request of some loaded adapter must finish) and then pays for moving the
adapter in. A replica whose engine runs the adapter already - by its scraped
``vllm:lora_requests_info``, or because this router sent it requests for it lately - serves at
once. The score says only that; the load scorer and the headroom filter spread a hot adapter
over more replicas as soon as its holders have no room.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetpilot.routing.policies.types import PickRequest, ReplicaView


class AdapterScorer:
    """Scorer: 1 for a replica that has the request's adapter, 0 for the others; nothing
    for a request of the base model (every replica has it)."""

    name = "adapter"

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        adapter = request.adapter
        if adapter is None:
            return {}
        return {v.id: 1.0 if adapter in v.adapters else 0.0 for v in replicas}
