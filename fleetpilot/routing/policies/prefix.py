"""Prefix-cache affinity: chained block hashes of the prompt and a per-replica LRU index of the
blocks sent to each replica (the *guessed* index), and the scorers that read it or, for replicas
whose engines publish KV events, the truth (``PickRequest.known``). Purely computational.

An engine with prefix caching (vLLM's automatic prefix caching) skips the prefill of every full
KV block whose whole prefix it has seen before. Where an engine publishes no KV events (or the
router has no tokenizer for its model) the router cannot see its cache, so it predicts it: it
remembers, per replica, the prompt blocks it sent there, in an LRU the size of that replica's KV
cache, and prefers the replica where the longest leading run of the new prompt's blocks is
remembered. That guess misses evictions, restarts and what other router replicas sent.

Blocks are cut from the prompt *text* (characters, not tokens: the guess needs no tokenizer, and
a fixed character count keeps the cut stable across requests sharing a prefix). Each block's hash
covers the model name and every block before it, so a hit on block k means blocks 0..k match too,
exactly like the engine's own block hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from fleetpilot.api.router_config import HOST_HIT_COST
from fleetpilot.routing.policies.types import PickRequest, ReplicaView

# What a prompt block a replica must compute costs, in blocks of waiting (``PrefillCostScorer``):
# this request's wait for it and that of the requests behind it.
UNCACHED_BLOCK_COST = 2.0

# A 256k-character prompt (~64k tokens) is 4096 blocks of 64; hashing is ~0.2 us a block, so
# the cap bounds the router's work per request at about a millisecond.
MAX_BLOCKS = 4096


def block_hashes(
    text: str, model: str, block_chars: int, max_blocks: int = MAX_BLOCKS
) -> list[int]:
    """Chained hashes of the prompt's full blocks, seeded with the model name.

    Only full blocks count: engines cache only full KV blocks, and a partial tail would differ
    from the next request's longer tail anyway. Python's built-in ``hash`` is used (four times
    faster than blake2b here); its per-process seed does not matter because the index lives
    in the same process as the hashing.
    """
    if block_chars <= 0:
        raise ValueError("block_chars must be positive")
    count = min(len(text) // block_chars, max_blocks)
    current = hash(("fleetpilot-prefix", model))
    out: list[int] = []
    append = out.append
    for start in range(0, count * block_chars, block_chars):
        current = hash((current, text[start : start + block_chars]))
        append(current)
    return out


class PrefixIndex:
    """Per-replica LRU sets of block hashes sent there.

    An instance the router owns and passes to the scorer; never a module-level singleton.
    Purely computational: no I/O, no clock.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be at least 1")
        self.capacity_blocks = capacity_blocks
        self._lrus: dict[str, OrderedDict[int, None]] = {}

    def record(self, replica_id: str, hashes: Sequence[int]) -> None:
        """Remember that these blocks were sent to the replica (most recent use now).

        Inserted from the last block to the first, so a prompt's leading blocks are the most
        recently used and its tail is evicted first, as an engine frees a finished request's
        blocks tail first; evicting a head block would orphan every block after it.
        """
        if not hashes:
            return
        lru = self._lrus.get(replica_id)
        if lru is None:
            lru = self._lrus[replica_id] = OrderedDict()
        move = lru.move_to_end
        for h in reversed(hashes):
            if h in lru:
                move(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)

    def matched_blocks(self, replica_id: str, hashes: Sequence[int]) -> int:
        """Length of the leading run of ``hashes`` remembered for the replica."""
        lru = self._lrus.get(replica_id)
        if not lru:
            return 0
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def forget(self, replica_id: str) -> None:
        """Drop a replica that left (its cache went with it)."""
        self._lrus.pop(replica_id, None)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget every replica not in ``replica_ids``."""
        keep = set(replica_ids)
        for rid in [r for r in self._lrus if r not in keep]:
            del self._lrus[rid]

    def size(self, replica_id: str) -> int:
        lru = self._lrus.get(replica_id)
        return len(lru) if lru else 0


def matched_blocks(index: PrefixIndex, request: PickRequest, replica_id: str) -> float:
    """The leading blocks of the request's prompt (in ``hashes`` units) the replica caches, on
    its device or in host memory: by its engine's KV events when they speak for it, else by
    the guessed index."""
    if replica_id in request.known:
        return request.cached.get(replica_id, 0.0) * len(request.hashes)
    return index.matched_blocks(replica_id, request.hashes)


def host_blocks(request: PickRequest, replica_id: str) -> float:
    """Of ``matched_blocks``, those in the replica's host memory only (its engine's KV events
    say so; the guessed index knows no media)."""
    return request.host.get(replica_id, 0.0) * len(request.hashes)


class PrefixScorer:
    """Scorer: the fraction of the prompt's blocks predicted to be cached on each replica, on
    any medium (medium-blind: the baselines that use it weigh tiers alike)."""

    name = "prefix"

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        total = len(request.hashes)
        if total == 0:
            return {v.id: 0.0 for v in replicas}
        return {v.id: matched_blocks(self.index, request, v.id) / total for v in replicas}


class PrefillCostScorer:
    """Scorer: how soon the replica could start this request's first token, relative to the
    others, in blocks of prefill: the work ahead of it there plus the part of its prompt the
    replica does not cache. The cheapest scores 1; each other replica loses what it costs
    more, measured in this request's prompt (a whole prompt more: 0), so a block's difference
    is a small nudge that load can outweigh, not a verdict.

    The work ahead is this router's own prompt blocks still to be prefilled there
    (``pending_prefill``: exact, the uncached part of each request it sent that has no first
    token yet) plus a block for each request the new one would wait behind
    (``ReplicaView.ahead``: the engine's queue, every client's, a scrape old; or one while the
    batch is full). Not a whole prompt a queued request: most queued requests hit the cache,
    so pricing each at a full prompt sent a hot tenant off its replica at its first queued
    request and, once replicas share a machine's compute or their KV pool is small, paid for
    it in recomputed and evicted prefixes (``bench/router_kv_events.py --busy``: hit rate
    0.37 against longest-prefix match's 0.58 when evicting). Other router replicas' queued
    prefills count only as their requests: each router sees its own exactly.

    An uncached block costs ``2 + pressure + ahead`` (``UNCACHED_BLOCK_COST`` is the 2): once
    for this request, which waits for it, and once for the requests that arrive behind it
    there, which wait for it too - a prefill computed twice in the fleet is work the fleet
    does instead of serving; on a replica whose engine is evicting (``PickRequest.pressure``,
    from its KV events) a miss also pushes other prompts' prefixes out, and their next
    requests pay for it again; on one with requests waiting, computing it delays every one
    of them. Priced at 1, a prompt left its cached replica whenever the prefill queued there
    outgrew it by one prompt - on a fleet whose working set spans the replicas' caches, every
    cold prompt somewhere sent the next ones elsewhere to be computed again, which made more
    cold prompts (``fleetpilot simulate``, 8 H100s, 400 tenants: TTFT p95 351 ms against
    longest-prefix match's 178; at 2, 73 ms; ``bench/simulate_whatifs.py hot-tenants``).

    A block the replica holds in host memory only (KV offloading: after its device prefix,
    ``PickRequest.host``) costs ``host_hit_cost`` (the router config's ``kvIndex.hostHitCost``,
    derived at ``HOST_HIT_COST``): the copy back to the GPU, a tenth of its prefill or less,
    which this request waits for and nobody else - vLLM's connector copies it while the
    engine runs the batch on. The device block the copy fills evicts another, as a miss's
    would, but on an offloading engine what it evicts stays in host memory, a copy away, so
    eviction pressure adds only ``c`` times itself and is left out. So with ``c`` that cost,
    ``m`` the price of an uncached block above and ``h`` the host blocks:

        cost = pending + ahead + m * (total - matched) + c * h    (``matched`` counts ``h``)

    a device hit costs nothing, a host hit ``c``, a miss ``m >= 1``: between the two, and a
    host hit outweighs a miss as long as ``c < m``.

    Cache affinity and load in one currency, without a hard filter: a hot tenant's concurrent
    requests stay where their prefix is while the queue there costs less than computing the
    prompt afresh elsewhere, and spread once it costs more - sooner onto a replica with room,
    later onto one that would have to evict for it; one system prompt shared by every user
    spreads as soon as its replica's queue outgrows the shared part.
    """

    name = "prefill-cost"

    def __init__(
        self,
        index: PrefixIndex,
        block_cost: float = UNCACHED_BLOCK_COST,
        host_hit_cost: float = HOST_HIT_COST,
    ) -> None:
        if block_cost < 1.0:
            raise ValueError("an uncached block costs at least its own prefill (1)")
        if not 0.0 <= host_hit_cost <= 1.0:
            raise ValueError("a host block costs between a device hit (0) and a prefill (1)")
        self.index = index
        self.block_cost = block_cost
        self.host_hit_cost = host_hit_cost

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        total = len(request.hashes)
        pressure = request.pressure
        # The requests that will wait behind an uncached block: ``block_cost - 1`` on a
        # replica that gets the group's mean traffic, in proportion elsewhere.
        behind = self.block_cost - 1.0
        mean = sum(v.recent_sends for v in replicas) / len(replicas) if replicas else 0.0
        host = self.host_hit_cost
        costs = {
            v.id: v.pending_prefill
            + v.ahead
            + (
                1.0
                + (behind * v.recent_sends / mean if mean > 0 else behind)
                + pressure.get(v.id, 0.0)
                + v.ahead
            )
            * (total - matched_blocks(self.index, request, v.id))
            + host * host_blocks(request, v.id)
            for v in replicas
        }
        best = min(costs.values(), default=0.0)
        scale = max(total, 1)
        return {rid: 1.0 - min(1.0, (cost - best) / scale) for rid, cost in costs.items()}
