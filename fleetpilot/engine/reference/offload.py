"""The host tier of the KV cache: vLLM's native CPU offloading (``--kv-offloading-size``).

vLLM 0.33's ``OffloadingConnector`` with its ``CPUOffloadingManager``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/``, ``vllm/v1/kv_offload/cpu/``)
keeps a second copy of prompt KV blocks in host memory, and this module is the reference
engine's version of it, block for block (vLLM's default chunk is one KV block):

- *Write-through.* Each step, the full prompt blocks a request computed are offered for storing
  (``offload_prompt_only``, vLLM's default); blocks already in the tier are skipped. A store
  first evicts, least recently used first, as many idle blocks as it needs (ready, not being
  loaded, not among those offered); when too few are idle the offer fails and is retried the
  next step. The store is a copy from the device pool out to the host tier, and the block is
  servable only once the copy completed.
- *Loads.* A request's admission takes the longest device prefix hit, then the longest run of
  host blocks right after it, and loads those into fresh device blocks: a real tensor copy,
  paced by the link's bandwidth. The request waits for it (vLLM's ``WAITING_FOR_REMOTE_KVS``)
  while other requests keep stepping, then computes only the rest. A lookup that meets a block
  still being written, or being loaded for another request, defers the request a step, as
  vLLM does (the other load will make them a device hit).
- *Events.* ``BlockRemoved`` (medium ``CPU``) when a store evicts, one event for the blocks one
  store evicted; ``BlockStored`` (medium ``CPU``) when a store completes, one event per block.
  Without ``self_describing_kv_events`` (vLLM's default) a stored event is vLLM's placeholder
  (the block's hash, no parent, no tokens, ``block_size`` 0); with it, the block's parent hash,
  token ids, block size and LoRA adapter, as ``OffloadingEventsTracker._take_stored_event``
  fills them. The engine publishes the device pool's events first and these after, in the
  order they happened, as vLLM's scheduler appends the connector's events to the block pool's.
  A reset of the tier emits nothing (vLLM's ``reset_cache`` does not).

``HostTier`` is pure bookkeeping (no tensors, no clock); ``TransferLink`` is the pacing
arithmetic; ``HostKVStore`` holds the tier's tensor. The engine (engine.py) joins them.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from fleetpilot.engine.reference.blocks import KVCacheSpec, KVPool
from fleetpilot.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, Event

# Host-to-device bandwidth of the default link, bytes a second: PCIe 4.0 x16 moves about 25 GB/s
# from pinned host memory, the bus most inference GPUs sit on (PCIe 5.0 doubles it). At that rate
# a CPU-sized model's blocks load in microseconds, as a GPU's would against its own prefill rate
# (a host hit costs about a tenth of recomputing the prefill); a benchmark that wants the same
# ratio on the reference engine's much slower CPU prefill sets a lower rate.
DEFAULT_BANDWIDTH_BYTES_PER_S = 25e9

# vLLM's CPUOffloadingSpec rounds each chunk up to the host page (its mmap region's alignment)
# when it divides cpu_bytes_to_use into chunks.
PAGE_BYTES = mmap.PAGESIZE

# vLLM's buckets for the load and store size histograms, in bytes (offloading/metrics.py), and
# for the blocks one store allocates (cpu/spec.py).
TRANSFER_SIZE_BUCKETS: tuple[float, ...] = (
    1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6,
)  # fmt: skip
ALLOCATION_SIZE_BUCKETS: tuple[float, ...] = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144,
)  # fmt: skip


@dataclass
class SizeHistogram:
    """A cumulative histogram kept as a Prometheus one exposes it (bounds without +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # at or below each bound
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.count += 1
        self.sum += value

    def copy(self) -> SizeHistogram:
        return SizeHistogram(self.bounds, list(self.counts), self.count, self.sum)


@dataclass(frozen=True)
class OffloadConfig:
    """The host tier's settings (vLLM's flags and extra config, and the link's bandwidth)."""

    capacity_bytes: int  # --kv-offloading-size, in bytes
    bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH_BYTES_PER_S
    # kv_connector_extra_config: self_describing_kv_events (vLLM's default off), and
    # offload_prompt_only (vLLM's default on: decode blocks are not offloaded).
    self_describing_kv_events: bool = False
    offload_prompt_only: bool = True

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ValueError(f"the host tier's size must not be negative: {self.capacity_bytes}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"the host tier's bandwidth must be positive: {self.bandwidth_bytes_per_s}"
            )

    @staticmethod
    def block_bytes(spec: KVCacheSpec) -> int:
        """Host memory one block takes: its KV rounded up to the page, as vLLM's chunks."""
        return -(-spec.bytes_per_block // PAGE_BYTES) * PAGE_BYTES

    def num_blocks(self, spec: KVCacheSpec) -> int:
        """Blocks the tier holds: vLLM's ``cpu_bytes_to_use // round_up(bytes per chunk, page)``."""
        return self.capacity_bytes // self.block_bytes(spec)


@dataclass(frozen=True)
class BlockMeta:
    """What a self-describing ``BlockStored`` says of one block (captured when it is stored)."""

    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora: tuple[int, str] | None = None


Rank = tuple[int, int]


@dataclass
class _Entry:
    slot: int
    rank: Rank  # recency: the lowest idle block is evicted first
    ready: bool = False  # the store completed: loads may read it
    loads: int = 0  # loads in flight reading it (it cannot be evicted meanwhile)


@dataclass
class _RequestAccess:
    """What one request did with the tier (vLLM's ``_RequestCacheAccess`` and request rank)."""

    rank: int | None = None
    seen: dict[bytes, int] = field(default_factory=dict)  # key -> its end-token position


@dataclass
class _RawEvent:
    removed: bool
    keys: list[bytes]


@dataclass
class HostTierStats:
    """Counters of the tier's bookkeeping (transfer bytes and times are the engine's)."""

    allocation_failures: int = 0  # stores refused for lack of idle blocks
    evictions: int = 0
    # Each store's number of newly allocated blocks (vLLM's cpu_allocation_size).
    allocation_size: SizeHistogram = field(
        default_factory=lambda: SizeHistogram(ALLOCATION_SIZE_BUCKETS)
    )


class HostTier:
    """Host-resident KV blocks by hash, their recency, and the CPU-medium KV events.

    Purely computational: methods take hashes and return host slots; ``HostKVStore`` holds the
    data those slots index. Invariant (``check_invariants``): every slot is either free or
    held by exactly one block, and only ready blocks with no load in flight may be evicted.

    Recency is vLLM's LRU policy (``vllm/v1/kv_offload/cpu/policies/lru.py``): a request gets a
    rank when it first stores or reads blocks, and each block it stores or reads is ranked
    ``(its rank, -position)``, so while requests run an older request's blocks go first and one
    request's tail before its head; when a request finishes (``finish``), the blocks it used are
    ranked anew, tail to head, the newest of all. Methods that take a request take each key's
    end-token position in it (``positions``): block ``i`` ends at ``(i + 1) * block_size``.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_kv_cache_events: bool = False,
        self_describing_kv_events: bool = False,
    ) -> None:
        if num_blocks < 0:
            raise ValueError(f"the host tier cannot hold {num_blocks} blocks")
        self.num_blocks = num_blocks
        self.entries: dict[bytes, _Entry] = {}
        # Slots never used, then freed ones: popped from the end.
        self._free: list[int] = list(reversed(range(num_blocks)))
        self._next_rank = 0
        self._requests: dict[str, _RequestAccess] = {}
        self.enable_kv_cache_events = enable_kv_cache_events
        self.self_describing = enable_kv_cache_events and self_describing_kv_events
        self._raw_events: list[_RawEvent] = []
        self._meta: dict[bytes, BlockMeta] = {}
        self.stats = HostTierStats()

    # ---- queries ---------------------------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    @property
    def num_used(self) -> int:
        return len(self.entries)

    @property
    def num_pinned(self) -> int:
        """Blocks held by a transfer in flight: being written, or read by a load."""
        return sum(1 for e in self.entries.values() if not e.ready or e.loads > 0)

    @property
    def num_writing(self) -> int:
        return sum(1 for e in self.entries.values() if not e.ready)

    def eviction_order(self) -> list[bytes]:
        """The blocks that may be evicted, first to go first."""
        idle = [(e.rank, k) for k, e in self.entries.items() if e.ready and e.loads == 0]
        return [k for _, k in sorted(idle)]

    def lookup(self, keys: Sequence[bytes]) -> int | None:
        """How many of ``keys``, from the first, the tier holds; None to try again next step.

        None (vLLM's deferred lookup) when a block of that run is still being written, or is
        being loaded for another request: that load will make it a device hit.
        """
        hits = 0
        defer = False
        for key in keys:
            entry = self.entries.get(key)
            if entry is None:
                break
            defer |= not entry.ready or entry.loads > 0
            hits += 1
        return None if defer else hits

    # ---- recency ---------------------------------------------------------------------------

    def _request_rank(self, access: _RequestAccess) -> int:
        if access.rank is None:
            self._next_rank += 1
            access.rank = self._next_rank
        return access.rank

    def _access(self, request_id: str, keys: Sequence[bytes], positions: Sequence[int]) -> None:
        """A request's first use of ``keys``: each resident one ranks at least as its
        ``(request rank, -position)`` (vLLM's ``on_request_access``)."""
        access = self._requests.setdefault(request_id, _RequestAccess())
        new = [(k, p) for k, p in zip(keys, positions, strict=True) if k not in access.seen]
        if not new:
            return
        rank = self._request_rank(access)
        for key, position in new:
            access.seen[key] = position
            entry = self.entries.get(key)
            if entry is not None and entry.rank < (rank, -position):
                entry.rank = (rank, -position)

    def finish(self, request_id: str) -> None:
        """The request is done: the blocks it used become the most recent, its head last
        (vLLM's ``on_request_finished``)."""
        access = self._requests.pop(request_id, None)
        if access is None:
            return
        head_to_tail = sorted(access.seen, key=access.seen.__getitem__)
        for key in reversed(head_to_tail):
            entry = self.entries.get(key)
            if entry is not None:
                self._next_rank += 1
                entry.rank = (self._next_rank, 0)

    # ---- loads -----------------------------------------------------------------------------

    def prepare_load(
        self, request_id: str, keys: Sequence[bytes], positions: Sequence[int]
    ) -> list[int]:
        """Pin ``keys`` (ready blocks) for ``request_id``'s load and return their slots."""
        slots = []
        for key in keys:
            entry = self.entries[key]
            if not entry.ready:
                raise ValueError(f"host block {key.hex()} is not ready to be read")
            entry.loads += 1
            slots.append(entry.slot)
        self._access(request_id, keys, positions)
        return slots

    def complete_load(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or entry.loads == 0:
                raise ValueError(f"host block {key.hex()} has no load in flight")
            entry.loads -= 1

    # ---- stores ----------------------------------------------------------------------------

    def prepare_store(
        self,
        request_id: str,
        keys: Sequence[bytes],
        positions: Sequence[int],
        meta: Sequence[BlockMeta] | None = None,
    ) -> tuple[list[bytes], list[int]] | None:
        """Allocate slots for those of ``keys`` the tier lacks, evicting idle blocks.

        Returns the keys to copy out and their slots (both empty when the tier holds every key),
        or None, allocating nothing, when too few blocks are idle to make room (vLLM's
        allocation failure: the caller offers them again later). ``meta`` (one per key)
        describes the blocks for self-describing events.
        """
        to_store = [k for k in keys if k not in self.entries]
        ready = {k for k in keys if k in self.entries and self.entries[k].ready}
        # vLLM records the offer (new and ready blocks) before it allocates.
        offered = [
            (k, p) for k, p in zip(keys, positions, strict=True) if k in ready or k in to_store
        ]
        self._access(request_id, [k for k, _ in offered], [p for _, p in offered])
        if not to_store:
            return [], []
        self.stats.allocation_size.observe(len(to_store))
        need = len(to_store) - len(self._free)
        if need > 0:
            protected = set(keys)
            victims = [k for k in self.eviction_order() if k not in protected][:need]
            if len(victims) < need:
                self.stats.allocation_failures += 1
                return None
            for key in victims:
                self._free.append(self.entries.pop(key).slot)
            self.stats.evictions += len(victims)
            if self.enable_kv_cache_events:
                self._raw_events.append(_RawEvent(removed=True, keys=victims))
        rank = self._request_rank(self._requests[request_id])
        position = dict(zip(keys, positions, strict=True))
        slots = [self._free.pop() for _ in to_store]
        for key, slot in zip(to_store, slots, strict=True):
            self.entries[key] = _Entry(slot, rank=(rank, -position[key]))
        if self.self_describing and meta is not None:
            by_key = dict(zip(keys, meta, strict=True))
            for key in to_store:
                self._meta[key] = by_key[key]
        return to_store, slots

    def complete_store(self, keys: Iterable[bytes]) -> None:
        stored = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and not entry.ready:
                entry.ready = True
                stored.append(key)
        if stored and self.enable_kv_cache_events:
            self._raw_events.append(_RawEvent(removed=False, keys=stored))

    def reset(self) -> None:
        """Drop every block (vLLM's ``reset_cache``: no events; transfers in flight are void)."""
        self.entries.clear()
        self._free = list(reversed(range(self.num_blocks)))
        self._meta.clear()
        self._requests.clear()
        self._next_rank = 0

    # ---- events ----------------------------------------------------------------------------

    def take_events(self) -> list[Event]:
        """The CPU-medium KV events since the last call, in order, as vLLM's tracker emits them."""
        raw, self._raw_events = self._raw_events, []
        events: list[Event] = []
        removed: set[bytes] = set()
        for event in raw:
            if event.removed:
                events.append(BlockRemoved(block_hashes=list(event.keys), medium=MEDIUM_CPU))
                removed.update(event.keys)
            else:
                events += (self._stored_event(key) for key in event.keys)
        # A payload lives from its store to its removal (unless stored again meanwhile).
        for key in removed - self.entries.keys():
            self._meta.pop(key, None)
        return events

    def _stored_event(self, key: bytes) -> BlockStored:
        meta = self._meta.get(key) if self.self_describing else None
        if meta is None:  # vLLM's _placeholder_stored
            return BlockStored(
                block_hashes=[key],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium=MEDIUM_CPU,
                lora_name=None,
            )
        return BlockStored(
            block_hashes=[key],
            parent_block_hash=meta.parent,
            token_ids=list(meta.token_ids),
            block_size=meta.block_size,
            lora_id=meta.lora[0] if meta.lora is not None else None,
            medium=MEDIUM_CPU,
            lora_name=meta.lora[1] if meta.lora is not None else None,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        slots = [e.slot for e in self.entries.values()]
        assert len(set(slots)) == len(slots), "two host blocks share a slot"
        assert not set(slots) & set(self._free), "a held slot is also free"
        assert len(set(self._free)) == len(self._free), "a slot is free twice"
        assert len(slots) + len(self._free) == self.num_blocks, "a host slot leaked"
        assert all(e.loads >= 0 for e in self.entries.values())
        assert all(e.ready for e in self.entries.values() if e.loads > 0), "a load of a write"


@dataclass
class TransferLink:
    """One direction of the host-device link: transfers one after another at a fixed rate.

    Pure arithmetic on the caller's clock: ``schedule`` says when a transfer of ``nbytes``
    issued at ``now`` starts (after the ones before it) and completes.
    """

    bandwidth_bytes_per_s: float
    busy_until: float = float("-inf")

    def schedule(self, now: float, nbytes: int) -> tuple[float, float]:
        start = max(now, self.busy_until)
        done = start + nbytes / self.bandwidth_bytes_per_s
        self.busy_until = done
        return start, done


@dataclass
class Transfer:
    """A copy in flight between the device pool and the host tier."""

    kind: Literal["load", "store"]
    keys: tuple[bytes, ...]
    nbytes: int
    start: float
    done_at: float
    generation: int  # the tier's reset count when issued: older ones are void
    request_id: str | None = None  # the request a load is for


class HostKVStore:
    """The host tier's tensor: a ``KVPool`` of its blocks (same layout and dtype as the device
    pool), so a store or a load is one block copy."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int) -> None:
        self.pool = KVPool(spec, num_blocks)

    def store(self, device: KVPool, device_blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Copy ``device_blocks`` of the device pool into host ``slots``."""
        data, scales = device.export_blocks(device_blocks)
        self.pool.import_blocks(slots, data, scales)

    def load(self, device: KVPool, slots: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Copy host ``slots`` into ``device_blocks`` of the device pool."""
        data, scales = self.pool.export_blocks(slots)
        device.import_blocks(device_blocks, data, scales)

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes


__all__ = [
    "ALLOCATION_SIZE_BUCKETS",
    "DEFAULT_BANDWIDTH_BYTES_PER_S",
    "TRANSFER_SIZE_BUCKETS",
    "BlockMeta",
    "HostKVStore",
    "HostTier",
    "HostTierStats",
    "OffloadConfig",
    "SizeHistogram",
    "Transfer",
    "TransferLink",
]
