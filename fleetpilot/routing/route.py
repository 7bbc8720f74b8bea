"""A resolved request (``Resolved``) and a routing decision (``Route``): the tier, the
replica(s), and what the pick knew. No I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fleetpilot.api.router_config import RouterTier
from fleetpilot.api.spec import RoleName, ServingMode
from fleetpilot.routing.features import RequestFeatures
from fleetpilot.routing.policies.complexity import Target
from fleetpilot.routing.policies.types import PickRequest
from fleetpilot.routing.replica import ReplicaState


@dataclass(frozen=True)
class Resolved:
    """A request as the router resolves it once (``Router.resolve``): its features, the tier
    it targets (by name, model or complexity) and, for a tenant limited to some tiers, the
    indexes of those it may use. The proxy carries it from admission to the decision."""

    features: RequestFeatures
    target: Target
    permitted: frozenset[int] | None = None


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
    # The prompt's full KV blocks by where the prefilling replica gets them - its device
    # cache, host memory (KV offloading), computing them - when its engine's events judged
    # it; None when the guessed index did (it knows no media, and counts text blocks).
    kv_blocks: tuple[int, int, int] | None = None

    @property
    def sent_prefill_blocks(self) -> int:
        """Prompt blocks the replica the request is sent to computes, pending there until its
        first chunk: a P/D decode replica prefills nothing (it pulls the KV), unless it was
        sent the request to prefill the few tokens it lacks itself."""
        return self.prefill_blocks if not self.disaggregated or self.local_prefill else 0

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
        """The ``x-fleetpilot-route`` value: tier, prefix-match (the fraction of the prompt's
        blocks the prefilling replica will not compute) and its source, where the engines'
        events judged it the prompt's KV blocks by tier (``kv-blocks=device:12,host:4,
        computed:8``: device cache hits, copies back from host memory, blocks to compute),
        reason (and for a P/D tier whether the prefill hop ran). Replica addresses only with
        ``addresses``: they are the fleet's internal pod IPs, for debugging, not for every
        client to read."""
        parts = [f"tier={self.tier.name}"]
        if self.adapter is not None:
            parts.append(f"adapter={self.adapter}")
        if addresses:
            parts.append(f"replica={(replica or self.replica).id}")
        parts += [
            f"prefix-match={self.prefix_match:.2f}",
            f"prefix-source={self.prefix_source}",
        ]
        if self.kv_blocks is not None:
            device, host, computed = self.kv_blocks
            parts.append(f"kv-blocks=device:{device},host:{host},computed:{computed}")
        parts.append(f"reason={self.reason}")
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
