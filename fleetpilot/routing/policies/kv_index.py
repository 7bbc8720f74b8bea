"""What the engines actually cache, from their KV events: block content -> replicas holding it.
Purely computational (no I/O, no clock); ``fleetpilot.routing.kv_events_client`` feeds it.

Engines name blocks by opaque hashes (sha256 bytes or 64-bit ints in vLLM, another scheme in the
reference engine, a per-process random seed in vLLM unless ``PYTHONHASHSEED`` is set), so two
replicas holding the same prefix do not report the same hash. The index keys on *content*
instead: a block's key chains its parent's key, the LoRA name, the block size and its token ids,

    key_0 = H(ROOT, lora, block_size, tokens_0),  key_i = H(key_{i-1}, lora, block_size, tokens_i)

exactly as an engine chains its own hashes, so a key names a whole prefix: equal keys on two
replicas mean the same leading tokens, and a request's prompt chained the same way matches
them. Per replica it keeps ``engine hash -> key`` (a ``BlockRemoved`` names engine hashes, and a
``BlockStored``'s ``parent_block_hash`` is an engine hash whose key starts the next chain); one
global LRU map ``key -> bitmask of replica slots`` answers matches.

What it does not see: vLLM's ``extra_keys`` (multimodal hashes, ``cache_salt``) are not part of
the key, so a salted request may be predicted a hit it will not get (a routing hint, never a
correctness issue); events of other media than the GPU (``CPU``/``STORAGE`` offload tiers) are
ignored; ``group_idx`` of hybrid models is not in the contract, so every group's events land in
one per-replica map.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

from fleetpilot.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
)

# The bound, on (replica, engine block) entries, i.e. on the blocks the fleet's engines hold.
# A 70B-class model (80 layers x 8 KV heads x 128 dims x K and V x 2 bytes = 320 KiB a token)
# on 4 x H100-80GB at 0.9 memory utilisation keeps ~148 GB for KV once its 140 GB of weights are
# loaded: ~450k tokens, 28k blocks of 16. An 8B model on one H100: 128 KiB a token, ~56 GB of
# KV, ~27k blocks. So ~32k blocks an engine; 16 engines a router indexes (every tier and role
# together) is 2**19 entries. Measured at ~330 bytes an entry (key, LRU slot, both per-replica
# maps, a 32-byte engine hash), that is ~170 MB at the bound, held only when the fleet really
# caches that much. A larger fleet passes a larger ``max_blocks``.
DEFAULT_MAX_BLOCKS = 32_768 * 16

# A request chained beyond this many blocks (128k tokens of 16) is matched on its head only:
# the bound on the router's hashing work per request (~1 us a block).
MAX_MATCH_BLOCKS = 8192

# How many engine hashes of one replica may name the same content key. vLLM hashes extra keys
# (cache_salt, multimodal inputs) into its block hash that the content key leaves out, so a few
# aliases are legitimate; an unbounded number would let one replica's events grow its map
# outside the LRU's reach.
MAX_ALIASES = 4

# The memory of a replica's eviction pressure, in block events: each stored or removed block
# moves it this fraction towards 0 or 1. A few prompts' worth of blocks, so the pressure says
# what the engine does now (evicting or still filling), not what it did an hour ago; counted in
# events rather than seconds, so a replica nobody sends to keeps the pressure it had - its cache
# is as full as when it went quiet.
EVICTION_MEMORY_BLOCKS = 256

KEY_BYTES = 16
# The parent key of a prompt's first block.
ROOT = bytes(KEY_BYTES)
_KEEP = 1.0 - 1.0 / EVICTION_MEMORY_BLOCKS
_NO_LORA = (0xFFFFFFFF).to_bytes(4, "little")
_BIG_ENDIAN = sys.byteorder == "big"


def _salt(block_size: int, lora_name: str | None) -> bytes:
    """The per-event part of every block's hashed bytes, length-prefixed so that no (LoRA name,
    tokens) pair can spell another's bytes."""
    if lora_name is None:
        lora = _NO_LORA
    else:
        raw = lora_name.encode("utf-8", "surrogatepass")
        lora = len(raw).to_bytes(4, "little") + raw
    return block_size.to_bytes(4, "little") + lora


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    *,
    parent: bytes = ROOT,
    max_blocks: int | None = None,
) -> list[bytes]:
    """The content keys of the full blocks of ``token_ids``, chained from ``parent``.

    blake2b (hashlib's C implementation; xxhash is not installed) at 16 bytes: stable across
    processes and machines, unlike Python's seeded ``hash``, so every router replica and every
    test computes the same keys, and a collision among even 10**9 blocks is a 1-in-10**20 event.
    Raises ``ValueError`` for a block size below 1 or a token id outside 0 .. 2**32-1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    if count == 0:
        return []
    try:
        packed = array("I", token_ids[: count * block_size])
    except OverflowError as e:
        raise ValueError("a token id is outside 0 .. 2**32-1") from e
    if _BIG_ENDIAN:  # little-endian on every host, so every machine computes the same keys
        packed.byteswap()
    data = packed.tobytes()
    salt = _salt(block_size, lora_name)
    step = 4 * block_size
    keys: list[bytes] = []
    append = keys.append
    key = parent
    for start in range(0, count * step, step):
        key = blake2b(key + salt + data[start : start + step], digest_size=KEY_BYTES).digest()
        append(key)
    return keys


@dataclass
class _Replica:
    slot: int
    hashes: dict[BlockHash, bytes] = field(default_factory=dict)  # engine hash -> key
    keys: dict[bytes, list[BlockHash]] = field(default_factory=dict)  # key -> engine hashes
    block_size: int | None = None
    # Moving share of removals among the replica's recent block events, in [0, 1).
    removals: float = 0.0


@dataclass
class Applied:
    """What applying one batch did, for the caller's counters."""

    events: int = 0
    # Blocks skipped because their parent's engine hash was unknown (events missed before
    # the subscription, or the parent evicted by the LRU): their content cannot be chained.
    unknown_parent_blocks: int = 0
    invalid_events: int = 0  # inconsistent BlockStored (token count, block size, token range)
    # The content keys of the blocks the batch stored (the router stops treating them as
    # merely sent: the engine has spoken for them).
    stored: list[bytes] = field(default_factory=list)


@dataclass
class IndexStats:
    """Cumulative counts since the index was made."""

    evicted_keys: int = 0
    unknown_parent_blocks: int = 0
    unknown_removed: int = 0
    aliases_dropped: int = 0
    other_medium_events: int = 0


def _slots(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class KVIndex:
    """Block content -> replicas holding it, from the engines' KV events; LRU-bounded.

    Costs: a ``BlockStored`` of n blocks is n blake2b calls and O(n) dict work; a
    ``BlockRemoved`` is O(1) a hash; a match of n blocks is n blake2b calls plus O(n + r) for r
    replicas holding its head (one AND of bitmasks a block); dropping or clearing a replica is
    O(its blocks); eviction is O(1) amortised per stored block.

    An instance the router owns, never a module-level singleton.
    """

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self.stats = IndexStats()
        # key -> bitmask of the slots of replicas holding it; order = least recently used first.
        self._holders: OrderedDict[bytes, int] = OrderedDict()
        self._replicas: dict[str, _Replica] = {}
        self._owners: list[str | None] = []  # slot -> replica id
        self._free: list[int] = []
        self._blocks = 0

    # -- reads -------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Distinct content keys held by any replica."""
        return len(self._holders)

    @property
    def blocks(self) -> int:
        """(replica, engine block) entries: what ``max_blocks`` bounds."""
        return self._blocks

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def replica_blocks(self, replica: str) -> int:
        rep = self._replicas.get(replica)
        return len(rep.hashes) if rep is not None else 0

    def block_size(self, replica: str) -> int | None:
        """The block size of the replica's latest ``BlockStored`` (what to chain a request with
        to match that replica), None before its first."""
        rep = self._replicas.get(replica)
        return rep.block_size if rep is not None else None

    def eviction_pressure(self, replica: str) -> float:
        """How hard the replica's engine is evicting now, in [0, 1]: 0 while its cache still has
        free blocks (it only stores), 1 once every block it stores displaces a cached one (as
        many removals as stores). An engine emits ``BlockRemoved`` only when it reuses a cached
        block for new content, so removals are evictions, never a finished request's free.

        What a prompt sent where it is not cached costs beyond its own prefill: on a replica
        under pressure its blocks evict other prompts' prefixes, whose next requests miss."""
        rep = self._replicas.get(replica)
        return min(1.0, 2.0 * rep.removals) if rep is not None else 0.0

    def snapshot(self) -> dict[str, frozenset[bytes]]:
        """Per replica, the content keys it holds (tests compare indexes built two ways)."""
        return {rid: frozenset(rep.keys) for rid, rep in self._replicas.items() if rep.keys}

    def holds(self, replica: str, key: bytes) -> bool:
        rep = self._replicas.get(replica)
        return rep is not None and key in rep.keys

    def match(
        self,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None = None,
        *,
        max_blocks: int = MAX_MATCH_BLOCKS,
    ) -> dict[str, int]:
        """Per replica, how many leading full blocks of ``token_ids`` it holds (replicas holding
        none are left out). Marks the matched blocks used."""
        return self.match_keys(chain_keys(token_ids, block_size, lora_name, max_blocks=max_blocks))

    def match_keys(self, keys: Sequence[bytes]) -> dict[str, int]:
        """``match`` over keys the caller chained (and may have cached) with ``chain_keys``."""
        holders = self._holders
        owners = self._owners
        out: dict[str, int] = {}
        alive = 0
        n = 0
        for key in keys:
            mask = holders.get(key)
            if mask is None:
                break
            current = mask if n == 0 else alive & mask
            if not current:
                break
            for slot in _slots(alive & ~current):
                out[owners[slot]] = n  # type: ignore[index]
            alive = current
            n += 1
        for slot in _slots(alive):
            out[owners[slot]] = n  # type: ignore[index]
        # Most recently used last, the head last of all: a chain is evicted from its tail, as
        # an engine frees blocks, and never loses the head its other blocks hang from.
        move = holders.move_to_end
        for key in reversed(keys[:n]):
            move(key)
        return out

    # -- events ------------------------------------------------------------------------------
    def apply(self, replica: str, events: Iterable[Event]) -> Applied:
        """Apply one batch's events, in order, for ``replica``."""
        applied = Applied()
        for event in events:
            applied.events += 1
            if isinstance(event, BlockStored):
                try:
                    applied.unknown_parent_blocks += self.store(replica, event, applied.stored)
                except ValueError:
                    applied.invalid_events += 1
            elif isinstance(event, BlockRemoved):
                self.remove(replica, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear(replica)
        return applied

    def store(self, replica: str, event: BlockStored, stored: list[bytes] | None = None) -> int:
        """Index the event's blocks for ``replica`` (their keys appended to ``stored``);
        returns how many were skipped for an unknown parent. Raises ``ValueError`` for an
        inconsistent event (nothing applied)."""
        if event.medium not in (None, MEDIUM_GPU):
            self.stats.other_medium_events += 1
            return 0
        count = len(event.block_hashes)
        if event.block_size < 1 or len(event.token_ids) != count * event.block_size:
            raise ValueError(
                f"{count} blocks of {event.block_size} tokens carry {len(event.token_ids)} tokens"
            )
        rep = self._replica(replica)
        rep.removals *= _KEEP**count
        if event.parent_block_hash is None:
            parent = ROOT
        else:
            known = rep.hashes.get(event.parent_block_hash)
            if known is None:
                self.stats.unknown_parent_blocks += count
                return count
            parent = known
        keys = chain_keys(event.token_ids, event.block_size, event.lora_name, parent=parent)
        if stored is not None:
            stored += keys
        rep.block_size = event.block_size
        for engine_hash, key in zip(reversed(event.block_hashes), reversed(keys), strict=True):
            self._bind(rep, engine_hash, key)
        if event.parent_block_hash is not None and parent in self._holders:
            self._holders.move_to_end(parent)
        self._evict()
        return 0

    def remove(self, replica: str, event: BlockRemoved) -> None:
        if event.medium not in (None, MEDIUM_GPU):
            self.stats.other_medium_events += 1
            return
        rep = self._replicas.get(replica)
        if rep is None:
            self.stats.unknown_removed += len(event.block_hashes)
            return
        keep = _KEEP ** len(event.block_hashes)
        rep.removals = rep.removals * keep + 1.0 - keep
        for engine_hash in event.block_hashes:
            key = rep.hashes.get(engine_hash)
            if key is None:
                self.stats.unknown_removed += 1
            else:
                self._unbind(rep, engine_hash, key)

    def clear(self, replica: str) -> None:
        """The replica's engine forgot its prefix cache (``AllBlocksCleared``, a restart)."""
        rep = self._replicas.get(replica)
        if rep is None:
            return
        bit = 1 << rep.slot
        holders = self._holders
        for key in rep.keys:
            mask = holders[key] & ~bit
            if mask:
                holders[key] = mask
            else:
                del holders[key]
        self._blocks -= len(rep.hashes)
        rep.hashes = {}
        rep.keys = {}
        rep.removals = 0.0  # an empty cache has room

    def drop(self, replica: str) -> None:
        """Forget a replica that left (its cache went with it); its slot is reused."""
        if replica not in self._replicas:
            return
        self.clear(replica)
        rep = self._replicas.pop(replica)
        self._owners[rep.slot] = None
        self._free.append(rep.slot)

    def retain(self, replicas: Iterable[str]) -> None:
        """Drop every replica not in ``replicas``."""
        keep = set(replicas)
        for replica in [r for r in self._replicas if r not in keep]:
            self.drop(replica)

    # -- internals ---------------------------------------------------------------------------
    def _replica(self, replica: str) -> _Replica:
        rep = self._replicas.get(replica)
        if rep is None:
            if self._free:
                slot = self._free.pop()
                self._owners[slot] = replica
            else:
                slot = len(self._owners)
                self._owners.append(replica)
            rep = self._replicas[replica] = _Replica(slot)
        return rep

    def _bind(self, rep: _Replica, engine_hash: BlockHash, key: bytes) -> None:
        holders = self._holders
        old = rep.hashes.get(engine_hash)
        if old == key:
            holders.move_to_end(key)
            return
        if old is not None:  # the engine reused a hash for other content: the newer one wins
            self._unbind(rep, engine_hash, old)
        aliases = rep.keys.get(key)
        if aliases is None:
            rep.keys[key] = [engine_hash]
            holders[key] = holders.get(key, 0) | (1 << rep.slot)
        elif len(aliases) >= MAX_ALIASES:
            self.stats.aliases_dropped += 1
            holders.move_to_end(key)
            return
        else:
            aliases.append(engine_hash)
        rep.hashes[engine_hash] = key
        self._blocks += 1
        holders.move_to_end(key)

    def _unbind(self, rep: _Replica, engine_hash: BlockHash, key: bytes) -> None:
        del rep.hashes[engine_hash]
        self._blocks -= 1
        aliases = rep.keys[key]
        aliases.remove(engine_hash)
        if aliases:
            return
        del rep.keys[key]
        mask = self._holders[key] & ~(1 << rep.slot)
        if mask:
            self._holders[key] = mask
        else:
            del self._holders[key]

    def _evict(self) -> None:
        holders = self._holders
        while self._blocks > self.max_blocks:
            key, mask = holders.popitem(last=False)
            self.stats.evicted_keys += 1
            for slot in _slots(mask):
                owner = self._owners[slot]
                assert owner is not None  # a slot in a mask always has its replica
                rep = self._replicas[owner]
                for engine_hash in rep.keys.pop(key):
                    del rep.hashes[engine_hash]
                    self._blocks -= 1


__all__ = [
    "DEFAULT_MAX_BLOCKS",
    "EVICTION_MEMORY_BLOCKS",
    "MAX_ALIASES",
    "MAX_MATCH_BLOCKS",
    "ROOT",
    "Applied",
    "IndexStats",
    "KVIndex",
    "chain_keys",
]
