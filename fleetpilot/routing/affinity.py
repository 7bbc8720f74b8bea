"""Prefix-cache affinity, the router's one plugin for it: what a request's prompt shares with
each replica's cache, as the ``PickRequest`` the pick's scorers read. No I/O.

``Affinity`` owns the evidence - the KV index (what the engines' KV events say they cache), the
recent sends (what this router sent where in the moments the events cannot have reported yet),
the guessed prefix index (what this router sent where, for groups without live events) and the
tier models' tokenizers - and turns a request into evidence (``evidence``), with the tie key that
lets every router replica break a tie alike.

Which index judges a group's replicas: the KV index when the tier has a tokenizer and every
replica of the group publishes live events (then N router processes, reading the same streams,
score a prompt alike); otherwise the guessed index for the whole group, so one silent publisher
never sets a truthful "nothing cached" against a guess of "cached".

Tokenizing a long cold prompt for those keys costs tens of milliseconds: ``prepare`` says which
keys a decision would compute and whether that is over ``OFF_LOOP_TOKENIZE_CHARS``, so the proxy
can compute them in a worker thread and hand them to the decision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fleetpilot.api.router_config import RouterConfig, RouterTier
from fleetpilot.api.spec import RoleName, ServingMode
from fleetpilot.routing.features import Kind, RequestFeatures
from fleetpilot.routing.policies.candidates import HOME_CANDIDATES, holder_candidates
from fleetpilot.routing.policies.kv_index import MAX_MATCH_BLOCKS, KVIndex, Match
from fleetpilot.routing.policies.prefix import PrefixIndex, block_hashes, matched_blocks
from fleetpilot.routing.policies.recent import RecentSends
from fleetpilot.routing.policies.types import PickRequest
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.replica_set import TIER_STATE_MAX_AGE_S, LargeGroup, ReplicaSet
from fleetpilot.routing.tokenizer.errors import TokenizerError

# A tie is broken by the key of a block this far past the deepest match in the fleet: far
# enough to clear a chat template's header, which every prompt shares (the reference
# template's is one 16-token block, Llama 3's about two) and a cold fleet caches nowhere
# yet, and near enough to stay inside a tenant's system prompt or a user's own history, so
# the requests that will share a prefix break their ties alike.
TIE_KEY_LOOKAHEAD_BLOCKS = 4

# A request whose tokenizing would encode more characters than this (past what the tokenizer's
# prefix cache holds) has its KV-index keys computed in a worker thread (``PreparedKeys``), not on
# the proxy's event loop, where it would stall every stream the router relays. Encoding runs at
# ~0.6 us a character (bench/router_tokenize.py, byte-level BPE), so 2,048 characters stall the
# loop ~1.2 ms at most, a tenth of an engine's ~10-30 ms between two tokens of a stream, and the
# thread hop (~50-100 us) would add a tenth to that. A conversation's next turn (a few hundred
# new characters, ~0.3-0.9 ms) stays inline; a cold 2,000-token conversation (~8k characters,
# ~5 ms) or a cold prompt at the 128k-character cap (~40-80 ms) goes to the thread.
OFF_LOOP_TOKENIZE_CHARS = 2048


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


def roles_of(tier: RouterTier) -> tuple[RoleName, ...]:
    """The roles a request of the tier is picked in: decode then prefill, or unified."""
    if tier.mode is ServingMode.DISAGGREGATED:
        return (RoleName.DECODE, RoleName.PREFILL)
    return (RoleName.UNIFIED,)


class Affinity:
    """The prefix-cache evidence of every group, and the keys of a request to read it with."""

    def __init__(
        self,
        replicas: ReplicaSet,
        config: RouterConfig,
        clock: Callable[[], float],
        *,
        kv_index: KVIndex | None = None,
        kv_live: Callable[[str], bool] | None = None,
    ) -> None:
        self.replicas = replicas
        self.clock = clock
        self.kv_index = kv_index if kv_index is not None else KVIndex()
        # The index's bound while the config sets none (a simulator's own, or the default).
        self._index_blocks = self.kv_index.max_blocks
        # Whether an event stream is heard from now (the KV-events client's ``has_events``).
        self.kv_live: Callable[[str], bool] = kv_live or (lambda _stream: False)
        # Per tier name, the tokenizer the app loaded for it; absent: guess from text.
        self.tokenizers: dict[str, PromptKeys] = {}
        self.recent = RecentSends()
        self.prefix_index = PrefixIndex(config.prefix_index_blocks)
        self.configure(config)

    def configure(self, config: RouterConfig) -> None:
        """Adopt a (re)loaded config; the guessed index is kept unless its size changed, the
        KV index always (its bound and its reading of host blocks follow the config)."""
        if config.prefix_index_blocks != self.prefix_index.capacity_blocks:
            self.prefix_index = PrefixIndex(config.prefix_index_blocks)
        self.kv_index.host_blocks = config.kv_index.host_blocks
        bound = config.kv_index.max_blocks or self._index_blocks
        if bound != self.kv_index.max_blocks:
            self.kv_index.resize(bound)
        self.config = config
        self._block_sizes = {
            (t.name, g.role): g.block_size for t in config.tiers for g in t.endpoints
        }

    def retain(self, replica_ids: Mapping[str, ReplicaState]) -> None:
        """Forget what was sent to replicas that are gone."""
        self.prefix_index.retain(replica_ids)
        self.recent.retain(replica_ids)

    # -- a request's keys ------------------------------------------------------------------------
    def guessed_hashes(self, features: RequestFeatures, model: str) -> list[int]:
        """The prompt's guessed-index block hashes (none without affinity). An adapter's KV
        differs from the base model's for the same prompt: as vLLM's block hashes do, they
        name what computed them (``model``: the adapter, else the tier's model)."""
        if self.config.affinity.weight <= 0:
            return []
        return block_hashes(features.prompt_text, model, self.config.affinity.block_chars)

    def keys(self, tier: RouterTier, features: RequestFeatures, adapter: str | None) -> RequestKeys:
        """The request's KV-index keys for the tier, computed as a decision asks for them."""
        return RequestKeys(self.tokenizers.get(tier.name), features, adapter)

    def prepare(
        self, tier: RouterTier, features: RequestFeatures, adapter: str | None
    ) -> PreparedKeys | None:
        """The KV-index keys a decision for the tier would compute - at the block sizes of the
        groups whose events would judge the request - looked up in the tokenizer's prefix
        cache but not yet computed; None when it would compute none."""
        if features.payload is None or tier.name not in self.tokenizers:
            return None
        hashed = 0 < self.config.affinity.block_chars <= len(features.prompt_text)
        sizes = [b for role in roles_of(tier) if (b := self.block_size(tier, role, hashed))]
        if not sizes:
            return None
        keys = self.keys(tier, features, adapter)
        return PreparedKeys(tier.name, keys, tuple(dict.fromkeys(sizes)))

    # -- evidence --------------------------------------------------------------------------------
    def block_size(self, tier: RouterTier, role: RoleName, hashed: bool) -> int | None:
        """The block size at which the prompt's KV-index keys are matched against a group's
        events, or None when its events do not judge the prompt: no replicas, no full block of
        prompt text (``hashed`` false) or no affinity, or a replica without live events."""
        group = self.replicas.group(tier.name, role)
        if not group or not hashed or self.config.affinity.weight <= 0:
            return None
        large = self.replicas.large(tier.name, role)
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

    def evidence(
        self, tier: RouterTier, role: RoleName, hashes: list[int], keys: RequestKeys, now: float
    ) -> tuple[PickRequest, list[bytes]]:
        """What the pick knows of the prompt for one role's replicas, and the prompt's KV-index
        keys (empty when not computed): the KV index's matches - or, where longer, what this
        router sent there in the last moments, which the events cannot have reported yet -
        when every replica of the group publishes live events and the prompt could be
        tokenized; else only the guessed index's hashes."""
        block_size = self.block_size(tier, role, bool(hashes))
        if block_size is None:
            return PickRequest(hashes), []
        chained = keys.get(block_size)
        if chained is None:
            return PickRequest(hashes), []
        group = self.replicas.group(tier.name, role)
        large = self.replicas.large(tier.name, role)
        known = large.ids if large is not None else frozenset(r.id for r in group)
        if not chained:
            return PickRequest(hashes, known), []
        held = self.kv_index.match_tiers(chained)
        if large is None:
            depths, hosts = self._depths(group, held, chained, now)
        else:
            depths, hosts = self._large_depths(large, held, chained, now)
        # The KV-index keys are content hashes, the same in every router replica (the guessed
        # index's are salted per process), so only here can a tie be broken alike everywhere.
        deepest = max(depths.values(), default=0)
        tie_key = chained[min(deepest + TIE_KEY_LOOKAHEAD_BLOCKS, len(chained) - 1)]
        candidates = None
        if large is not None:
            holders = holder_candidates(depths, self.replicas.demand)
            home = large.ring.successors(tie_key, HOME_CANDIDATES)
            candidates = tuple(dict.fromkeys([*holders, *home]))
        cached = {}
        host = {}
        pressure = {}
        for rid in candidates if candidates is not None else (r.id for r in group):
            blocks = depths.get(rid, 0)
            if blocks:
                cached[rid] = blocks / len(chained)
                if hosts.get(rid):
                    host[rid] = hosts[rid] / len(chained)
            streams = self.replicas[rid].kv_streams
            evicting = max(map(self.kv_index.eviction_pressure, streams))
            if evicting:
                pressure[rid] = evicting
        request = PickRequest(
            hashes,
            known,
            cached,
            host=host,
            pressure=pressure,
            tie_key=tie_key,
            candidates=candidates,
        )
        return request, chained

    def _depths(
        self, group: Sequence[ReplicaState], held: Match, chained: list[bytes], now: float
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Per replica of the group that holds some of the prompt, its leading blocks held,
        and of those the ones in host memory only (absent: none)."""
        depths = {}
        hosts = {}
        blocks_of, host_of = held.blocks, held.host
        for r in group:
            blocks = host = 0
            for s in r.kv_streams:  # the data-parallel rank holding the most, on the device
                got = blocks_of.get(s, 0)
                if got > blocks or (got == blocks and host_of.get(s, 0) < host):
                    blocks, host = got, host_of.get(s, 0)
            blocks, host = with_recent(blocks, host, self.recent.matched(r.id, chained, now))
            if blocks:
                depths[r.id] = blocks
                if host:
                    hosts[r.id] = host
        return depths, hosts

    def _large_depths(
        self, large: LargeGroup, held: Match, chained: list[bytes], now: float
    ) -> tuple[dict[str, int], dict[str, int]]:
        """``_depths`` of a large group: read from the holders (by the KV index's ``held`` per
        stream, or by what this router just sent there), not from every replica."""
        depths: dict[str, int] = {}
        hosts: dict[str, int] = {}
        owner = large.stream_owner
        for stream, blocks in held.blocks.items():
            rid = owner.get(stream)
            if rid is not None and blocks > depths.get(rid, 0):
                depths[rid] = blocks
                hosts[rid] = held.host.get(stream, 0)
        recent = self.recent
        for rid in recent.holders(chained, now, above=max(depths.values(), default=0)):
            if rid in large.ids:
                depths[rid], hosts[rid] = with_recent(
                    depths.get(rid, 0), hosts.get(rid, 0), recent.matched(rid, chained, now)
                )
        return depths, {rid: h for rid, h in hosts.items() if h}

    def uncached_tokens(
        self,
        tier: RouterTier,
        request: PickRequest,
        replica: str,
        chained: Sequence[bytes],
        keys: RequestKeys,
    ) -> tuple[int, int] | None:
        """The prompt tokens, and blocks, a decode replica would compute itself if sent the
        request without a prefill hop; ``request`` and ``chained`` are the decode pick's.
        Known only when its group's events judged the prompt and its keys cover the whole
        prompt."""
        if replica not in request.known:
            return None
        block_size = self.block_size(tier, RoleName.DECODE, bool(request.hashes))
        total = keys.prompt_tokens(chained)
        if block_size is None or total is None:
            return None
        held = round(request.cached.get(replica, 0.0) * len(chained))
        tokens = total - held * block_size
        return tokens, -(-tokens // block_size)

    # -- what was sent where ---------------------------------------------------------------------
    def matched(self, request: PickRequest, replica_id: str) -> float:
        """The prompt's blocks the replica holds, by the evidence the pick read."""
        return matched_blocks(self.prefix_index, request, replica_id)

    @staticmethod
    def kv_blocks(
        request: PickRequest, replica_id: str, chained: Sequence[bytes]
    ) -> tuple[int, int, int] | None:
        """The prompt's full KV blocks (``chained``) by where the replica gets them: from its
        device cache, copied back from host memory, computed - when its engine's events judged
        it (None: the guessed index did, which knows no media and no KV blocks)."""
        if replica_id not in request.known:
            return None
        blocks = round(request.cached.get(replica_id, 0.0) * len(chained))
        host = round(request.host.get(replica_id, 0.0) * len(chained))
        return blocks - host, host, len(chained) - blocks

    def sent(
        self,
        replica_id: str,
        hashes: Sequence[int],
        chained: Sequence[bytes],
        now: float,
        *,
        prefills: bool = True,
    ) -> None:
        """The request goes to the replica: its blocks are there soon (``prefills``: it computes
        them; a P/D decode replica pulls them, so the guessed index learns nothing)."""
        if prefills:
            self.prefix_index.record(replica_id, hashes)
        self.recent.record(replica_id, chained, now)


def with_recent(blocks: int, host: int, recent: int) -> tuple[int, int]:
    """A replica's leading blocks held and host blocks among them, given the ``recent`` leading
    blocks this router just sent there: those are on its device soon (computed, or copied back
    from host memory), whatever its events said a moment ago."""
    device = max(blocks - host, recent)
    return max(blocks, recent), max(0, blocks - device)


@dataclass(frozen=True)
class PreparedKeys:
    """A request's KV-index keys for one tier at the block sizes a decision would match them
    at (``Affinity.prepare``), to compute ahead of the decision with ``compute``."""

    tier: str
    keys: RequestKeys
    block_sizes: tuple[int, ...]

    @property
    def off_loop(self) -> bool:
        """Whether computing them costs more than an event loop should stall for: the
        tokenizer would encode over ``OFF_LOOP_TOKENIZE_CHARS`` characters (or, for a request
        too long to look up cheaply, carries that many)."""
        return self.keys.pending_chars() > OFF_LOOP_TOKENIZE_CHARS

    def compute(self) -> None:
        """Compute the keys at every block size, on any thread: the tokenizer is thread-safe,
        and the decision reads them only after this returned."""
        for block_size in self.block_sizes:
            self.keys.get(block_size)


class RequestKeys:
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
