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

Two media, per replica (issue 46). An engine with KV offloading (vLLM's native CPU tier) writes
each prompt block through to host memory as it computes it, so the same block is usually on both
media of one replica, and each medium evicts its copy on its own: ``GPU`` events say what the
device pool holds, ``CPU`` events what the host tier holds. Per (replica, engine hash) the index
keeps whether the device holds it and how many times the host tier announced it: vLLM's
offloading connector stores chunks of several blocks, and chunks overlapping a prefix shared
only in part re-announce the shared hashes, once per chunk (and remove them once per chunk), so
host copies are reference-counted; device ones are not (vLLM re-announces a device block on
every prefix-cache hit, with no removal to match). A request matches per replica its *device
prefix* (the leading blocks on the GPU) and, after it, its *host run* (the blocks the connector
loads from host memory: it looks them up only where the device prefix ends, so a block on both
media counts as a device hit, and a device-only block after the device prefix ends the run).
How a host block is read is the caller's choice (``HostBlocks``): tiered, as a device hit
(medium-blind), or not at all (host events dropped at ingest).

What it does not see: vLLM's ``extra_keys`` (multimodal hashes, ``cache_salt``) are not part of
the key, so a salted request may be predicted a hit it will not get (a routing hint, never a
correctness issue); ``STORAGE``-medium events (disk or remote tiers, far slower than a copy
from host memory) are counted and ignored, as are the host tier's placeholder events (vLLM's
default without ``self_describing_kv_events``: one hash, no tokens, nothing to key on);
``group_idx`` of hybrid models is not in the contract, so every group's events land in one
per-replica map.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

from fleetpilot.api.router_config import HostBlocks
from fleetpilot.kv_events import (
    MEDIUM_CPU,
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
# together) is 2**19 entries. Measured at ~360 bytes an entry (key, LRU slot, both per-replica
# maps, a 32-byte engine hash; 16 replicas; ~400 for a block on both media, its host count
# kept apart), that is ~190 MB at the bound, held only when the fleet really caches that much.
# A block on both media
# of one replica is one entry, so an offloading engine counts its host tier's blocks (written
# through, a superset of its device's): a larger fleet, or one with host tiers, passes a larger
# ``max_blocks`` (the router config's ``kvIndex.maxBlocks``).
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

# Where an engine block is, per (replica, engine hash): bit 0 the device holds it, the bits
# above how many times the host tier announced it (its chunks that hold it). A device-only
# block, the only kind without offloading, is stored as no entry at all (``_DEVICE``).
_DEVICE = 1
_HOST = 2
# In the index's masks each replica slot has two bits: 2*slot its device copy, 2*slot + 1 its
# host copy.
_TWO_BITS = 3


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
    # engine hash -> where it is (``_DEVICE`` bit, host count above it); absent: device only.
    media: dict[BlockHash, int] = field(default_factory=dict)
    block_size: int | None = None
    # Moving share of removals among the replica's recent device block events, in [0, 1).
    removals: float = 0.0


@dataclass
class Applied:
    """What applying one batch did, for the caller's counters."""

    events: int = 0
    # Blocks skipped because their parent's engine hash was unknown (events missed before
    # the subscription, or the parent evicted by the LRU): their content cannot be chained.
    unknown_parent_blocks: int = 0
    invalid_events: int = 0  # inconsistent BlockStored (token count, block size, token range)
    # Host-tier BlockStored without content (vLLM's default, without self-describing events).
    placeholder_events: int = 0
    # The content keys of the blocks the batch stored on the device (the router stops
    # treating them as merely sent: the engine has spoken for them).
    stored: list[bytes] = field(default_factory=list)


@dataclass
class IndexStats:
    """Cumulative counts since the index was made."""

    evicted_keys: int = 0
    unknown_parent_blocks: int = 0
    unknown_removed: int = 0
    aliases_dropped: int = 0
    # Events of a medium the index does not read (STORAGE; CPU with ``HostBlocks.IGNORED``).
    other_medium_events: int = 0
    # Host-tier BlockStored that name one hash and no tokens (vLLM without
    # ``self_describing_kv_events``): nothing to key their content on.
    placeholder_events: int = 0


@dataclass(frozen=True, slots=True)
class Match:
    """Per replica holding some of a request's leading blocks (``KVIndex.match_tiers``):
    ``blocks``, how many it holds - its device prefix and the host run after it - and
    ``host``, how many of those are in host memory only (absent: none)."""

    blocks: dict[str, int]
    host: dict[str, int]


class KVIndex:
    """Block content -> replicas holding it and on which medium, from the engines' KV events;
    LRU-bounded.

    Costs: a ``BlockStored`` of n blocks is n blake2b calls and O(n) dict work; a
    ``BlockRemoved`` is O(1) a hash; a match of n blocks is n blake2b calls plus O(n + r) for r
    replicas holding its head (a few ANDs of bitmasks a block); dropping or clearing a replica
    is O(its blocks); eviction is O(1) amortised per stored block.

    ``host_blocks`` says how host-tier (``CPU``) events count: indexed and matched as a host
    run (``TIERED``), indexed and matched as device hits (``AS_DEVICE``), or dropped at
    ingest (``IGNORED``). The router sets it from its config; a change reads the index as it
    is (host copies indexed before ``IGNORED`` stay until evicted or removed).

    An instance the router owns, never a module-level singleton.
    """

    def __init__(
        self, max_blocks: int = DEFAULT_MAX_BLOCKS, host_blocks: HostBlocks = HostBlocks.TIERED
    ) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self.host_blocks = host_blocks
        self.stats = IndexStats()
        # key -> two bits per replica slot (device, host); order = least recently used first.
        self._holders: OrderedDict[bytes, int] = OrderedDict()
        self._replicas: dict[str, _Replica] = {}
        self._owners: list[str | None] = []  # slot -> replica id
        self._free: list[int] = []
        self._device_bits = 0  # the device bit of every slot: 0b0101...01
        self._blocks = 0

    # -- reads -------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Distinct content keys held by any replica."""
        return len(self._holders)

    @property
    def blocks(self) -> int:
        """(replica, engine block) entries, a block on both media once: what ``max_blocks``
        bounds."""
        return self._blocks

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def replica_blocks(self, replica: str) -> int:
        rep = self._replicas.get(replica)
        return len(rep.hashes) if rep is not None else 0

    def host_blocks_of(self, replica: str) -> int:
        """The replica's engine blocks with a copy in host memory."""
        rep = self._replicas.get(replica)
        return sum(1 for state in rep.media.values() if state >= _HOST) if rep else 0

    def block_size(self, replica: str) -> int | None:
        """The block size of the replica's latest ``BlockStored`` (what to chain a request with
        to match that replica), None before its first."""
        rep = self._replicas.get(replica)
        return rep.block_size if rep is not None else None

    def eviction_pressure(self, replica: str) -> float:
        """How hard the replica's engine is evicting from its device pool now, in [0, 1]: 0
        while its cache still has free blocks (it only stores), 1 once every block it stores
        displaces a cached one (as many removals as stores). An engine emits ``BlockRemoved``
        only when it reuses a cached block for new content, so removals are evictions, never a
        finished request's free. Host-tier events do not move it.

        What a prompt sent where it is not cached costs beyond its own prefill: on a replica
        under pressure its blocks evict other prompts' prefixes, whose next requests miss."""
        rep = self._replicas.get(replica)
        return min(1.0, 2.0 * rep.removals) if rep is not None else 0.0

    def snapshot(self) -> dict[str, frozenset[bytes]]:
        """Per replica, the content keys it holds on any medium (tests compare indexes built
        two ways)."""
        return {rid: frozenset(rep.keys) for rid, rep in self._replicas.items() if rep.keys}

    def holds(self, replica: str, key: bytes, medium: str | None = None) -> bool:
        """Whether the replica holds the key: on any medium, or on ``medium`` (GPU, CPU)."""
        rep = self._replicas.get(replica)
        if rep is None or key not in self._holders:
            return False
        bits = self._holders[key] >> 2 * rep.slot
        if medium is None:
            return bool(bits & _TWO_BITS)
        return bool(bits & (_HOST if medium == MEDIUM_CPU else _DEVICE))

    def match(
        self,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None = None,
        *,
        max_blocks: int = MAX_MATCH_BLOCKS,
    ) -> dict[str, int]:
        """Per replica, how many leading full blocks of ``token_ids`` it holds, device prefix
        and host run together (replicas holding none are left out). Marks the matched blocks
        used."""
        return self.match_keys(chain_keys(token_ids, block_size, lora_name, max_blocks=max_blocks))

    def match_keys(self, keys: Sequence[bytes]) -> dict[str, int]:
        """``match`` over keys the caller chained (and may have cached) with ``chain_keys``."""
        return self.match_tiers(keys).blocks

    def match_tiers(self, keys: Sequence[bytes]) -> Match:
        """Per replica, its leading blocks of ``keys`` and how many of them only host memory
        holds: the device prefix, then the run of host blocks the engine's offloading
        connector would load after it. With ``HostBlocks.AS_DEVICE`` a block on either medium
        counts as a device hit (``host`` is empty). Marks the matched blocks used."""
        blocks: dict[str, int] = {}
        host: dict[str, int] = {}
        n = self._match(keys, blocks, host)
        # Most recently used last, the head last of all: a chain is evicted from its tail, as
        # an engine frees blocks, and never loses the head its other blocks hang from.
        move = self._holders.move_to_end
        for key in reversed(keys[:n]):
            move(key)
        return Match(blocks, host)

    def _match(self, keys: Sequence[bytes], blocks: dict[str, int], host: dict[str, int]) -> int:
        """Fills ``blocks`` and ``host`` (``match_tiers``); returns the deepest match.

        Bit-parallel over replica slots, each at its device bit (2*slot): ``on_device`` and
        ``on_host`` are the slots holding block n on each medium, ``in_device`` the slots
        whose every block so far is on the device, ``in_host`` those whose device prefix ended
        and whose host run goes on; a slot leaves both when block n is on neither medium it
        may use next."""
        holders = self._holders
        owners = self._owners
        device_bits = self._device_bits
        blind = self.host_blocks is HostBlocks.AS_DEVICE
        # Host copies indexed before the index was told to ignore them are not read.
        deaf = self.host_blocks is HostBlocks.IGNORED
        in_device = in_host = 0
        # Where each slot's device prefix ended, for the slots now in their host run.
        device_ends: dict[int, int] = {}
        n = 0
        for key in keys:
            mask = holders.get(key)
            if mask is None:
                break
            if blind:
                mask = (mask | mask >> 1) & device_bits
            elif deaf:
                mask &= device_bits
            on_device = mask & device_bits
            if n:
                device_next = in_device & on_device
                if device_next == in_device and not in_host:
                    n += 1  # every replica still matching holds it on the device: the norm
                    continue
                on_host = (mask >> 1) & device_bits
                moved = in_device & ~on_device & on_host
                host_next = (in_host & on_host) | moved
            else:
                device_next = on_device
                moved = host_next = (mask >> 1) & device_bits & ~on_device
            if not (device_next or host_next):
                break
            while moved:
                low = moved & -moved
                device_ends[low] = n
                moved ^= low
            gone = (in_device | in_host) & ~(device_next | host_next)
            while gone:
                low = gone & -gone
                self._record(owners[low.bit_length() >> 1], n, device_ends, low, blocks, host)
                gone ^= low
            in_device = device_next
            in_host = host_next
            n += 1
        alive = in_device | in_host
        while alive:
            low = alive & -alive
            self._record(owners[low.bit_length() >> 1], n, device_ends, low, blocks, host)
            alive ^= low
        return n

    @staticmethod
    def _record(
        owner: str | None,
        n: int,
        device_ends: dict[int, int],
        low: int,
        blocks: dict[str, int],
        host: dict[str, int],
    ) -> None:
        """The replica's match ends at ``n`` blocks, its host run at ``device_ends[low]``."""
        assert owner is not None  # a slot in a mask always has its replica
        blocks[owner] = n
        end = device_ends.get(low)
        if end is not None:
            host[owner] = n - end

    def resize(self, max_blocks: int) -> None:
        """Bound the index at ``max_blocks`` entries from now on, evicting down to it."""
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._evict()

    # -- events ------------------------------------------------------------------------------
    def apply(self, replica: str, events: Iterable[Event]) -> Applied:
        """Apply one batch's events, in order, for ``replica``."""
        applied = Applied()
        placeholders = self.stats.placeholder_events
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
        applied.placeholder_events = self.stats.placeholder_events - placeholders
        return applied

    def _medium(self, medium: str | None) -> int | None:
        """The state bit an event of ``medium`` adds or takes (``_DEVICE``, ``_HOST``), or
        None (counted) for a medium the index does not read."""
        if medium is None or medium == MEDIUM_GPU:
            return _DEVICE
        if medium == MEDIUM_CPU and self.host_blocks is not HostBlocks.IGNORED:
            return _HOST
        self.stats.other_medium_events += 1
        return None

    def store(self, replica: str, event: BlockStored, stored: list[bytes] | None = None) -> int:
        """Index the event's blocks for ``replica`` (their keys appended to ``stored`` when
        they are on the device); returns how many were skipped for an unknown parent. Raises
        ``ValueError`` for an inconsistent event (nothing applied)."""
        medium = self._medium(event.medium)
        if medium is None:
            return 0
        count = len(event.block_hashes)
        if medium == _HOST and event.block_size == 0 and not event.token_ids:
            # vLLM's placeholder: the offload key's hash alone, parent None, no tokens.
            self.stats.placeholder_events += 1
            return 0
        if event.block_size < 1 or len(event.token_ids) != count * event.block_size:
            raise ValueError(
                f"{count} blocks of {event.block_size} tokens carry {len(event.token_ids)} tokens"
            )
        rep = self._replica(replica)
        if medium == _DEVICE:
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
        if stored is not None and medium == _DEVICE:
            stored += keys
        rep.block_size = event.block_size
        bit = medium << 2 * rep.slot
        bind = self._bind
        for engine_hash, key in zip(reversed(event.block_hashes), reversed(keys), strict=True):
            bind(rep, engine_hash, key, medium, bit)
        if event.parent_block_hash is not None and parent in self._holders:
            self._holders.move_to_end(parent)
        self._evict()
        return 0

    def remove(self, replica: str, event: BlockRemoved) -> None:
        """Take the event's blocks off its medium for ``replica``: a device removal clears the
        device copy, a host one takes one of the host tier's announcements back; a block on
        neither medium any more leaves the index."""
        medium = self._medium(event.medium)
        if medium is None:
            return
        rep = self._replicas.get(replica)
        if rep is None:
            self.stats.unknown_removed += len(event.block_hashes)
            return
        if medium == _DEVICE:
            keep = _KEEP ** len(event.block_hashes)
            rep.removals = rep.removals * keep + 1.0 - keep
        media = rep.media
        for engine_hash in event.block_hashes:
            key = rep.hashes.get(engine_hash)
            state = media.get(engine_hash, _DEVICE)
            held = state & _DEVICE if medium == _DEVICE else state >= _HOST
            if key is None or not held:
                self.stats.unknown_removed += 1  # not there, or not on this medium
                continue
            state -= medium
            if state == 0:
                self._unbind(rep, engine_hash, key)
                continue
            if state == _DEVICE:
                del media[engine_hash]
            else:
                media[engine_hash] = state
            self._refresh(rep, key)

    def clear(self, replica: str) -> None:
        """The replica's engine forgot its prefix cache (``AllBlocksCleared``, a restart): both
        media, as the event names none."""
        rep = self._replicas.get(replica)
        if rep is None:
            return
        bits = ~(_TWO_BITS << 2 * rep.slot)
        holders = self._holders
        for key in rep.keys:
            mask = holders[key] & bits
            if mask:
                holders[key] = mask
            else:
                del holders[key]
        self._blocks -= len(rep.hashes)
        rep.hashes = {}
        rep.keys = {}
        rep.media = {}
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
                self._device_bits |= _DEVICE << 2 * slot
            rep = self._replicas[replica] = _Replica(slot)
        return rep

    def _bind(
        self, rep: _Replica, engine_hash: BlockHash, key: bytes, medium: int, bit: int
    ) -> None:
        """The replica holds the block on ``medium`` (``bit``: its bit in the key's mask)."""
        holders = self._holders
        old = rep.hashes.get(engine_hash)
        if old == key:
            media = rep.media
            state = media.get(engine_hash, _DEVICE)
            if medium == _HOST:  # one more chunk holds it: counted
                media[engine_hash] = state + _HOST
            elif not state & _DEVICE:  # a device copy of a host block; a repeat is idempotent
                media[engine_hash] = state | _DEVICE
            holders[key] |= bit
            holders.move_to_end(key)
            return
        if old is not None:  # the engine reused a hash for other content: the newer one wins
            self._unbind(rep, engine_hash, old)
        aliases = rep.keys.get(key)
        if aliases is None:
            rep.keys[key] = [engine_hash]
        elif len(aliases) >= MAX_ALIASES:
            self.stats.aliases_dropped += 1
            holders.move_to_end(key)
            return
        else:
            aliases.append(engine_hash)
        rep.hashes[engine_hash] = key
        if medium != _DEVICE:
            rep.media[engine_hash] = medium
        holders[key] = holders.get(key, 0) | bit
        self._blocks += 1
        holders.move_to_end(key)

    def _refresh(self, rep: _Replica, key: bytes) -> None:
        """Set the replica's two bits of ``key`` from the media of its engine hashes."""
        media = rep.media
        bits = 0
        for engine_hash in rep.keys[key]:
            state = media.get(engine_hash, _DEVICE)
            bits |= (state & _DEVICE) | (_HOST if state >= _HOST else 0)
        shift = 2 * rep.slot
        self._holders[key] = self._holders[key] & ~(_TWO_BITS << shift) | bits << shift

    def _unbind(self, rep: _Replica, engine_hash: BlockHash, key: bytes) -> None:
        del rep.hashes[engine_hash]
        rep.media.pop(engine_hash, None)
        self._blocks -= 1
        aliases = rep.keys[key]
        aliases.remove(engine_hash)
        if aliases:
            self._refresh(rep, key)
            return
        del rep.keys[key]
        mask = self._holders[key] & ~(_TWO_BITS << 2 * rep.slot)
        if mask:
            self._holders[key] = mask
        else:
            del self._holders[key]

    def _evict(self) -> None:
        holders = self._holders
        owners = self._owners
        device_bits = self._device_bits
        while self._blocks > self.max_blocks:
            key, mask = holders.popitem(last=False)
            self.stats.evicted_keys += 1
            slots = (mask | mask >> 1) & device_bits
            while slots:
                low = slots & -slots
                owner = owners[low.bit_length() >> 1]
                assert owner is not None  # a slot in a mask always has its replica
                rep = self._replicas[owner]
                for engine_hash in rep.keys.pop(key):
                    del rep.hashes[engine_hash]
                    rep.media.pop(engine_hash, None)
                    self._blocks -= 1
                slots ^= low


__all__ = [
    "DEFAULT_MAX_BLOCKS",
    "EVICTION_MEMORY_BLOCKS",
    "MAX_ALIASES",
    "MAX_MATCH_BLOCKS",
    "ROOT",
    "Applied",
    "IndexStats",
    "KVIndex",
    "Match",
    "chain_keys",
]
