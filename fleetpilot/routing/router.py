"""The router's decisions: which tier, which replica. No I/O.

``Router`` runs the pure policies over state it asks of its owners: the replicas and their
counts (``replica_set.ReplicaSet``), the prefix-cache evidence (``affinity.Affinity``), the LoRA
adapters sent where (``adapter_holders.AdapterHolders``) and the ejection tracker. The HTTP layer
(``proxy``) resolves a request once (``resolve``), asks for its route (``decide``) and reports
back successes and failures; the app's ``KVEventsClient`` feeds the affinity's KV index and says
which event streams are live.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from fleetpilot.api.router_config import RouterConfig, RouterTier
from fleetpilot.api.spec import RoleName, ServingMode
from fleetpilot.routing.adapter_holders import AdapterHolders
from fleetpilot.routing.affinity import Affinity, PreparedKeys, PromptKeys, RequestKeys
from fleetpilot.routing.endpoints import EndpointSource
from fleetpilot.routing.errors import (
    PermissionDeniedError,
    RouterError,
    UnavailableError,
)
from fleetpilot.routing.features import RequestFeatures
from fleetpilot.routing.group_picks import GroupPicks
from fleetpilot.routing.policies.adapters import AdapterScorer
from fleetpilot.routing.policies.candidates import FULL_SCAN_MAX
from fleetpilot.routing.policies.complexity import (
    DEFAULT_WEIGHTS,
    ComplexityWeights,
    TierChoice,
)
from fleetpilot.routing.policies.ejection import HealthTracker
from fleetpilot.routing.policies.kv_index import KVIndex
from fleetpilot.routing.policies.load import LoadScorer
from fleetpilot.routing.policies.picker import (
    Pick,
    WeightedScorer,
)
from fleetpilot.routing.policies.prefix import UNCACHED_BLOCK_COST, PrefillCostScorer, PrefixIndex
from fleetpilot.routing.policies.recent import RecentSends
from fleetpilot.routing.policies.types import Filter, PickRequest
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.replica_set import ReplicaSet
from fleetpilot.routing.route import Resolved, Route, adapter_of, serving_role
from fleetpilot.routing.tiers import Tiers

log = logging.getLogger(__name__)

# A P/D request whose prompt the chosen decode replica holds in its KV cache but for at most
# this many tokens (its engine's events say so) skips the prefill hop: the decode replica
# computes those few tokens itself. The hop is a round trip to a prefill replica, a forward
# pass there and a KV pull back; vLLM's NIXL decode side makes the same trade with the same
# number, recomputing rather than pulling fewer remote tokens than its kv_recompute_threshold
# (64 by default). A conversation's next turn on the replica that decoded the last one is the
# common case: its prompt is the last prompt and reply plus a short new message.
PD_LOCAL_PREFILL_TOKENS = 64


@dataclass(frozen=True)
class _Placed:
    """Where one decision puts a request: the replicas and what the pick knew (``Route``)."""

    request: PickRequest  # the prefilling replica's pick's (a retry picks with it again)
    replica: ReplicaState | None  # unified or decode; P/D: the prefill one until placed
    prefill: ReplicaState | None = None
    prefix_match: float = 0.0
    prefill_blocks: int = 0
    local_prefill: bool = False
    # The prompt's KV blocks on the prefilling replica by source (``Route.kv_blocks``).
    kv_blocks: tuple[int, int, int] | None = None


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
        self.rng = rng or random.Random()
        self.clock = clock
        self.weights = weights
        self.on_eject = on_eject
        # Called with the new replica set whenever discovery changes it (the app follows it
        # with its KV-event subscriptions).
        self.on_replicas = on_replicas
        self.replica_set = ReplicaSet(full_scan_max)
        self.affinity = Affinity(
            self.replica_set, config, clock, kv_index=kv_index, kv_live=kv_live
        )
        self.adapters = AdapterHolders(self.replica_set)
        self.apply_config(config)

    # -- the affinity's state, as the app, benchmarks and tests reach it -----------------------
    @property
    def tokenizers(self) -> dict[str, PromptKeys]:
        """Per tier name, the tokenizer the app loaded for it; absent: guess from text."""
        return self.affinity.tokenizers

    @property
    def kv_index(self) -> KVIndex:
        return self.affinity.kv_index

    @property
    def prefix_index(self) -> PrefixIndex:
        return self.affinity.prefix_index

    @property
    def recent(self) -> RecentSends:
        return self.affinity.recent

    # -- configuration and endpoints ---------------------------------------------------------
    def apply_config(self, config: RouterConfig) -> None:
        """Adopt a (re)loaded config; replica state of endpoints that remain is kept."""
        old = getattr(self, "config", None)
        self.config = config
        self._tiers = Tiers(config, self.weights)
        self.tiers = self._tiers.ordered
        self.affinity.configure(config)
        if (
            old is None
            or old.ejection.failures != config.ejection.failures
            or old.ejection.window != config.ejection.window
        ):
            self.health = HealthTracker(
                config.ejection.failures, config.ejection.window.total_seconds()
            )
        if old is None:
            self.picks = GroupPicks(self.replica_set, config, self.health, self.rng)
        else:
            self.picks.configure(config, self.health)
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
        self._suspect_after_s = {
            t.name: config.ejection.suspect_fraction * self.first_byte_timeout_s(t)
            for t in config.tiers
        }
        self.source.configure(config)
        self.replica_set.forget_version()
        self.sync()

    def affinity_scorers(self, block_cost: float = UNCACHED_BLOCK_COST) -> list[WeightedScorer]:
        """The scorers of unified and prefill picks as the config weighs them, an uncached
        prompt block priced at ``block_cost`` (benchmarks compare prices with
        ``use_policies(scorers=router.affinity_scorers(1.0))``) and one in host memory at the
        config's ``kvIndex.hostHitCost``."""
        config = self.config
        scorer = PrefillCostScorer(
            self.affinity.prefix_index, block_cost, config.kv_index.host_hit_cost
        )
        return [
            WeightedScorer(scorer, config.affinity.weight),
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
            self.picks.filters = list(filters)
        if scorers is not None:
            self._affinity_scorers = list(scorers)

    def sync(self) -> None:
        """Re-read the source's endpoints if they changed."""
        replicas = self.replica_set.sync(self.source, self._max_seqs, self._suspect_after_s)
        if replicas is None:
            return
        self.affinity.retain(replicas)
        self.health.retain(set(replicas))
        if self.on_replicas is not None:
            self.on_replicas(replicas)

    def replicas(self) -> list[ReplicaState]:
        self.sync()
        return self.replica_set.all()

    def replica(self, replica_id: str) -> ReplicaState | None:
        return self.replica_set.get(replica_id)

    def group(self, tier: str, role: str) -> list[ReplicaState]:
        return self.replica_set.group(tier, role)

    # -- tiers -------------------------------------------------------------------------------
    def resolve(self, features: RequestFeatures) -> Resolved:
        """The request's target tier and the tiers its tenant may use, worked out once per
        request (``Tiers.resolve``)."""
        return self._tiers.resolve(features)

    def waiting_tier(self, resolved: Resolved) -> RouterTier:
        """The tier a request waits for when every replica in its reach is saturated: its
        base tier, within what its tenant may use."""
        return self.tiers[resolved.target.index]

    def _choose_tier(self, resolved: Resolved, now: float) -> tuple[RouterTier, TierChoice]:
        return self._tiers.choose(resolved, lambda tier: self.picks.tier_state(tier, now))

    def _none_open(self, tier: RouterTier, message: str) -> RouterError:
        """The error for a pick that found no replica after ``tier_state`` said one was open:
        they filled in between (a race, or the tier state of a large group, read up to
        ``TIER_STATE_MAX_AGE_S`` ago), so the tier is at capacity - retry later."""
        if self.replica_set.large(tier.name, serving_role(tier)) is None:
            return UnavailableError(message, reason="no_ready_replicas")
        return self._tiers.overloaded()

    # -- decisions ---------------------------------------------------------------------------
    def prepare_keys(self, resolved: Resolved) -> PreparedKeys | None:
        """The KV-index keys ``decide`` would compute for this request now, looked up in the
        tokenizer's prefix cache but not yet computed (``Affinity.prepare``); None when
        ``decide`` would compute none. A caller may compute them (``PreparedKeys.compute``, on
        any thread: the proxy does so in a worker when ``off_loop``) and hand them to
        ``decide``, which uses them if it chooses the same tier."""
        if resolved.features.payload is None or not self.affinity.tokenizers:
            return None
        self.sync()
        try:
            tier, _ = self._choose_tier(resolved, self.clock())
        except RouterError:
            return None  # decide raises it
        return self.affinity.prepare(tier, resolved.features, adapter_of(tier, resolved.features))

    def decide(
        self, request: Resolved | RequestFeatures, prepared: PreparedKeys | None = None
    ) -> Route:
        """Tier, then replica(s), for a request ``resolve`` worked out (features alone are
        resolved here). ``prepared``: its keys from ``prepare_keys``, used if this decision
        chooses the tier they were prepared for; a tier's state may change between the two
        (a spill), and then this decision computes the keys of the tier it chose.

        Raises ``UnknownModelError``/``InvalidRequestError`` for a bad target,
        ``PermissionDeniedError`` (403) for a tier or adapter the tenant may not use,
        ``OverloadedError`` (429) when every eligible replica is full, and
        ``NoReplicaError`` (503) when no eligible tier has a Ready replica.
        """
        resolved = request if isinstance(request, Resolved) else self.resolve(request)
        with self.picks.one_decision():
            return self._decide(resolved, prepared)

    def _decide(self, resolved: Resolved, prepared: PreparedKeys | None) -> Route:
        self.sync()
        now = self.clock()
        features = resolved.features
        tier, choice = self._choose_tier(resolved, now)
        adapter = adapter_of(tier, features)
        allowed = features.allowed_adapters
        if adapter is not None and allowed is not None and adapter not in allowed:
            raise PermissionDeniedError(
                f"this API key may not use adapter {adapter!r}", reason="adapter_not_allowed"
            )
        hashes = self.affinity.guessed_hashes(features, adapter or tier.model)
        if prepared is not None and prepared.tier == tier.name:
            keys = prepared.keys
        else:
            keys = self.affinity.keys(tier, features, adapter)
        if tier.mode is ServingMode.DISAGGREGATED:
            placed = self._disaggregated(tier, adapter, hashes, keys, now)
        else:
            placed = self._prefilled_at(tier, RoleName.UNIFIED, adapter, hashes, keys, now)
        spilled = choice.spilled_from
        assert placed.replica is not None
        return Route(
            tier=tier,
            reason=choice.reason,
            replica=placed.replica,
            prefill=placed.prefill,
            prefix_match=placed.prefix_match,
            score=resolved.target.score,
            spilled_from=self.tiers[spilled].name if spilled is not None else None,
            adapter=adapter,
            prefill_blocks=placed.prefill_blocks,
            # Tokenizing happens inside the picks: whether it failed is known only now.
            tokenizer_failed=keys.failed,
            local_prefill=placed.local_prefill,
            request=placed.request,
            kv_blocks=placed.kv_blocks,
        )

    def _disaggregated(
        self,
        tier: RouterTier,
        adapter: str | None,
        hashes: list[int],
        keys: RequestKeys,
        now: float,
    ) -> _Placed:
        """A P/D request's replicas: the decode replica first - the decode role's events count
        too, as a decode replica that already holds the prompt's blocks pulls fewer of them -
        then the prefill replica, unless the decode replica holds all but a few of the prompt's
        tokens (``PD_LOCAL_PREFILL_TOKENS``) and computes them itself."""
        request, chained = self.affinity.evidence(tier, RoleName.DECODE, hashes, keys, now)
        request = self.adapters.with_adapter(tier, RoleName.DECODE, request, adapter)
        scorers = self._affinity_scorers if request.known else self._load_scorers
        decode = self.picks.pick(tier, RoleName.DECODE, request, now, scorers)
        if decode is None:
            raise self._none_open(tier, "no decode replica available")
        replica = self.replica_set[decode.replica.id]
        self.affinity.sent(replica.id, hashes, chained, now, prefills=False)
        self.adapters.sent(tier, replica, adapter, now)
        local = self.affinity.uncached_tokens(tier, request, replica.id, chained, keys)
        if local is not None and local[0] <= PD_LOCAL_PREFILL_TOKENS:
            return _Placed(
                request,
                replica,
                prefix_match=request.cached.get(replica.id, 0.0),
                prefill_blocks=local[1],
                local_prefill=True,
                kv_blocks=self.affinity.kv_blocks(request, replica.id, chained),
            )
        # Optional: with no sound prefill replica the decode replica prefills itself.
        placed = self._prefilled_at(
            tier, RoleName.PREFILL, adapter, hashes, keys, now, optional=True
        )
        return replace(placed, replica=replica, prefill=placed.replica)

    def _prefilled_at(
        self,
        tier: RouterTier,
        role: RoleName,
        adapter: str | None,
        hashes: list[int],
        keys: RequestKeys,
        now: float,
        *,
        optional: bool = False,
    ) -> _Placed:
        """The replica of ``role`` that computes the prompt; with ``optional`` (a P/D prefill
        replica) None when no replica is sound, else ``_none_open`` is raised."""
        request, chained = self.affinity.evidence(tier, role, hashes, keys, now)
        request = self.adapters.with_adapter(tier, role, request, adapter)
        chosen = self.picks.pick(
            tier, role, replace(request, optional=optional), now, self._affinity_scorers
        )
        if chosen is None:
            if not optional:
                raise self._none_open(tier, "no replica available")
            return _Placed(request, None, prefill_blocks=len(hashes))
        replica = self.replica_set[chosen.replica.id]
        matched = self.affinity.matched(request, replica.id)
        replica.note_send(now)
        self.affinity.sent(replica.id, hashes, chained, now)
        self.adapters.sent(tier, replica, adapter, now)
        return _Placed(
            request,
            replica,
            prefix_match=matched / len(hashes) if hashes else 0.0,
            prefill_blocks=round(len(hashes) - matched),
            kv_blocks=self.affinity.kv_blocks(request, replica.id, chained),
        )

    def _retry_pick(self, route: Route, tried: Iterable[str]) -> Pick | None:
        """The pick a retry of the route makes in its serving group, none of ``tried``."""
        self.sync()
        role = serving_role(route.tier)
        scorers = self._load_scorers if route.disaggregated else self._affinity_scorers
        return self.picks.pick(
            route.tier, role, route.request, self.clock(), scorers, frozenset(tried)
        )

    def alternative(self, route: Route, exclude: set[str]) -> ReplicaState | None:
        """Another replica of the route's serving group for a retry, or ``None``."""
        chosen = self._retry_pick(route, exclude)
        if chosen is None:
            return None
        state = self.replica_set[chosen.replica.id]
        if not route.disaggregated:
            state.note_send(self.clock())
            self.affinity.sent(state.id, route.hashes, (), self.clock())
        self.adapters.sent(route.tier, state, route.adapter, self.clock())
        return state

    def fallback(self, route: Route, tried: Iterable[str]) -> ReplicaState | None:
        """Where a retry of the route would go, none of ``tried``, with no send recorded: an
        endpoint picker's fallback, which the gateway uses only if the pick fails."""
        chosen = self._retry_pick(route, tried)
        return None if chosen is None else self.replica_set[chosen.replica.id]

    def has_sound_peer(self, route: Route, tried: Iterable[str]) -> bool:
        """Whether a retry of the route would find a replica of its serving group, none of
        ``tried``, that is neither ejected nor suspect and has room: where a request waiting on
        a suspect replica can go instead. The pick ``alternative`` would make, without its
        bookkeeping."""
        chosen = self._retry_pick(route, tried)
        return chosen is not None and not chosen.replica.ejected and not chosen.replica.suspect

    def batch_slots(self, tier_name: str) -> int:
        """The sequences the tier's serving replicas in rotation run at once."""
        self.sync()
        tier = self._tiers.named(tier_name)
        return sum(
            r.max_num_seqs
            for r in self.replica_set.group(tier.name, serving_role(tier))
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

    def record_adapter_missing(self, replica: ReplicaState, adapter: str) -> None:
        """The replica answered a request for ``adapter`` with 404: it has not loaded it yet
        (dynamic LoRA). Not a failure - it answered, and serves everything else - but for
        ``replica.ADAPTER_MISSING_S`` it scores last for the adapter and is no holder of it."""
        self.adapters.missing(replica, adapter, self.clock())
        log.info(
            "replica lacks adapter",
            extra={"replica": replica.id, "tier": replica.endpoint.tier, "adapter": adapter},
        )

    def record_adapter_served(self, replica: ReplicaState, adapter: str) -> None:
        """The replica answered a request for ``adapter``: any mark that it lacks it ends."""
        if replica.missing_adapters:
            replica.note_adapter_served(adapter)

    def readmit(self, replica_id: str) -> bool:
        replica = self.replica_set.get(replica_id)
        if replica is not None:
            replica.heard_from()  # its /health answered
        readmitted = self.health.readmit(replica_id)
        if readmitted:
            log.info("replica readmitted", extra={"replica": replica_id})
        return readmitted
