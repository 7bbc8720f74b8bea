"""Paged KV cache: block hashing, the block manager (pure bookkeeping) and the tensor pool.

The KV cache is cut into fixed-size blocks of ``block_size`` token slots. A sequence owns a
*block table*: the physical block ids holding its tokens in order, so its KV need not be
contiguous and memory is committed one block at a time instead of ``max_model_len`` up front
(PagedAttention).

A full block is identified by a chained hash: the hash of its parent block's hash and its own
tokens, so equal hashes mean equal *prefixes*, not just equal blocks. Requests with the same
prefix map those blocks to the same physical block (reference counted). A block that a sequence
frees keeps its hash and contents and sits in an LRU of free blocks: a later request with the
same prefix takes it back (a prefix-cache hit) until the allocator needs it for something else.

``BlockManager`` is pure bookkeeping (no tensors, no I/O): it answers "which slots" and "which
blocks to copy", and ``KVPool`` holds the one preallocated tensor those ids index.

KV events (vLLM's ``--kv-events-config``): with ``enable_kv_cache_events`` the block manager
records, as vLLM's block pool does, every change to what the prefix cache can serve, in the
wire format of :mod:`fleetpilot.kv_events`: ``BlockStored`` when full blocks enter the hash map
(one event per run of consecutive blocks of one sequence, with their token ids, so a consumer
can recompute the chain), ``BlockRemoved`` when a cached block's contents are dropped for reuse,
``AllBlocksCleared`` on a reset. It only appends to ``kv_events``; the engine takes them once a
step (``take_events``) and the publisher sends them. Block hashes go out as the 16-byte chained
hashes themselves.

LoRA: a request's adapter is part of every block hash (``extra``, as vLLM's
``_gen_lora_extra_hash_keys``), so KV computed under one adapter is never served to a request
under another; its ``BlockStored`` events carry the adapter's id and name, from which a router
chains the same content keys (``fleetpilot.routing.policies.kv_index.chain_keys``).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fleetpilot.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one token's KV across the model, which is what a block multiplies."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: torch.dtype = torch.float32
    # int8 stores K/V as int8 with one float32 scale per (token, kv head): a per-token scale can
    # be written once when the token is appended, where a per-block scale would force
    # re-quantizing the whole block whenever a larger value arrives.
    quantized: bool = False

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8 if self.quantized else self.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V, every layer, every slot of one block (plus int8 scales)."""
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem
        if self.quantized:
            per_token += 2 * self.num_layers * self.num_kv_heads * 4  # float32 scales
        return per_token * self.block_size

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        """How many whole blocks a memory budget holds."""
        return budget_bytes // self.bytes_per_block


_ROOT_HASH = b"fleetpilot-kv-root"


def hash_block(parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Chained hash of one full block: covers the parent's hash, so it names the whole prefix.

    ``extra``: what else the block's KV depends on (a LoRA adapter's key), hashed after the
    tokens, whose fixed width keeps the two apart.
    """
    h = hashlib.blake2b(parent if parent is not None else _ROOT_HASH, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    h.update(extra)
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, extra: bytes = b""
) -> None:
    """Append the hashes of the full blocks of ``token_ids`` that ``hashes`` does not cover yet."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i > 0 else None
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(parent, tokens, extra))


class NoFreeBlocksError(RuntimeError):
    """The pool has no free block left; the scheduler preempts and retries."""


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters in tokens, as vLLM reports them."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0  # cached blocks whose contents were dropped for reuse


class BlockManager:
    """Block tables, reference counts, the prefix-cache hash map and the free-block LRU.

    Purely computational: methods take and return ids. Invariant (checked by
    ``check_invariants``): every block is either referenced by a table (ref count > 0) or in the
    free LRU (ref count 0), never both and never neither, so the pool cannot leak.

    ``reserve_tokens`` turns this into the pre-PagedAttention baseline for benchmarks: a
    sequence's first allocation reserves room for that many tokens at once, as a contiguous
    per-request buffer of ``max_model_len`` would.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        enable_prefix_caching: bool = True,
        reserve_tokens: int | None = None,
        enable_kv_cache_events: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.reserve_tokens = reserve_tokens
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Free blocks, least valuable first: allocation pops from the front. Blocks without a
        # hash go to the front (nothing to lose), freed cached blocks to the back (LRU).
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.stats = PrefixCacheStats()
        self.enable_kv_cache_events = enable_kv_cache_events
        # Prefix-cache changes since the last take_events() (module docstring); stays empty
        # unless enable_kv_cache_events.
        self.kv_events: list[Event] = []

    def take_events(self) -> list[Event]:
        """The KV events recorded since the last call, oldest first (and forget them)."""
        events, self.kv_events = self.kv_events, []
        return events

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def table(self, seq_id: str) -> list[int]:
        return self.tables.get(seq_id, [])

    def match_prefix(self, block_hashes: Sequence[bytes], max_tokens: int) -> list[int]:
        """Physical blocks caching the longest prefix of ``block_hashes`` within ``max_tokens``.

        Reads only; the caller passes the result to ``allocate``. ``max_tokens`` lets the caller
        keep at least one token to compute (the last prompt token's logits are needed).
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in block_hashes[: max_tokens // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------------

    def _pop_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hashes[block]
        if old is not None:
            # Reusing a cached block drops its contents, so it must leave the hash map.
            if self.cached.get(old) == block:
                del self.cached[old]
                if self.enable_kv_cache_events:
                    self.kv_events.append(BlockRemoved(block_hashes=[old], medium=MEDIUM_GPU))
            self.block_hashes[block] = None
            self.stats.evictions += 1
        self.ref_counts[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]  # a prefix hit on a free cached block takes it back
        self.ref_counts[block] += 1

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.block_hashes[block] is None:
                self.free.move_to_end(block, last=False)

    def can_allocate(self, num_new_blocks: int, hit_blocks: Sequence[int] = ()) -> bool:
        # Hits that sit in the free LRU are taken out of it, so they are not free for others.
        reclaimed = sum(1 for b in hit_blocks if self.ref_counts[b] == 0)
        return num_new_blocks <= len(self.free) - reclaimed

    def allocate(
        self,
        seq_id: str,
        num_tokens: int,
        *,
        write_from: int,
        hit_blocks: Sequence[int] = (),
    ) -> list[tuple[int, int]] | None:
        """Make ``seq_id``'s table cover ``num_tokens`` tokens, written from ``write_from`` on.

        ``hit_blocks`` (prefix-cache hits, only on a sequence's first allocation) are shared
        rather than allocated. A shared block (ref count > 1) about to be written at
        ``write_from`` is copied first (copy-on-write): the returned ``(src, dst)`` pairs are the
        copies the caller must perform before writing. Returns None, changing nothing, when the
        pool lacks free blocks.
        """
        table = self.tables.get(seq_id)
        if table is None:
            table = []
        elif hit_blocks:
            raise ValueError("prefix-cache hits are only taken on a sequence's first allocation")
        target = num_tokens
        if not table and self.reserve_tokens is not None:
            target = max(target, self.reserve_tokens)
        num_new = max(0, self.blocks_for_tokens(target) - len(table) - len(hit_blocks))
        first_written = write_from // self.block_size
        cow = [
            i
            for i in range(first_written, min(len(table), self.blocks_for_tokens(num_tokens)))
            if self.ref_counts[table[i]] > 1
        ]
        if not self.can_allocate(num_new + len(cow), hit_blocks):
            return None
        for block in hit_blocks:
            self._ref(block)
        table.extend(hit_blocks)
        copies: list[tuple[int, int]] = []
        for i in cow:
            src = table[i]
            dst = self._pop_free()
            copies.append((src, dst))
            table[i] = dst
            self._unref(src)
        table.extend(self._pop_free() for _ in range(num_new))
        self.tables[seq_id] = table
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the same blocks as ``parent_id`` (parallel sampling, beam search).

        Nothing is copied now; the first write into a shared block copies it (``allocate``).
        """
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        table = list(self.tables.get(parent_id, []))
        for block in table:
            self._ref(block)
        self.tables[child_id] = table

    def free_seq(self, seq_id: str, *, keep_blocks: int = 0) -> list[int]:
        """Release ``seq_id``'s blocks, tail first so a prefix outlives its suffix in the LRU.

        With ``keep_blocks`` the first blocks stay referenced and are returned: the caller
        (the engine's P/D pinning) now owns one reference to each and gives it back with
        ``unref_blocks``.
        """
        table = self.tables.pop(seq_id, [])
        kept, released = table[:keep_blocks], table[keep_blocks:]
        for block in reversed(released):
            self._unref(block)
        return kept

    def unref_blocks(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            self._unref(block)

    def cache_full_blocks(
        self,
        seq_id: str,
        block_hashes: Sequence[bytes],
        num_computed_tokens: int,
        token_ids: Sequence[int] = (),
        *,
        lora: tuple[int, str] | None = None,
    ) -> None:
        """Publish ``seq_id``'s full, computed blocks in the prefix cache.

        Only blocks whose every slot holds computed KV of final tokens are published; the caller
        passes ``num_computed_tokens`` excluding speculative tokens not yet accepted.
        ``token_ids`` (the sequence's tokens, at least the computed ones) feed the
        ``BlockStored`` events and are needed only with ``enable_kv_cache_events``; so is
        ``lora``, the sequence's adapter (id, name), which they carry.
        """
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(seq_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
        if self.enable_kv_cache_events and len(token_ids) < num_full * self.block_size:
            raise ValueError(
                f"KV events need the token ids of {num_full} full blocks, got {len(token_ids)}"
            )
        run_start: int | None = None  # first block of the current run of newly cached blocks
        for i in range(num_full):
            block = table[i]
            h = block_hashes[i]
            # Already published (a hit, or cached in an earlier step), or another sequence
            # computed the same prefix first (keep theirs): nothing new for the cache.
            if self.block_hashes[block] is not None or h in self.cached:
                self._stored(run_start, i, block_hashes, token_ids, lora)
                run_start = None
                continue
            self.block_hashes[block] = h
            self.cached[h] = block
            if run_start is None:
                run_start = i
        self._stored(run_start, num_full, block_hashes, token_ids, lora)

    def _stored(
        self,
        start: int | None,
        end: int,
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        lora: tuple[int, str] | None,
    ) -> None:
        """Record a ``BlockStored`` for blocks ``start``..``end`` (exclusive) of a sequence."""
        if not self.enable_kv_cache_events or start is None or start >= end:
            return
        bs = self.block_size
        self.kv_events.append(
            BlockStored(
                block_hashes=list(block_hashes[start:end]),
                parent_block_hash=block_hashes[start - 1] if start > 0 else None,
                token_ids=list(token_ids[start * bs : end * bs]),
                block_size=bs,
                lora_id=lora[0] if lora is not None else None,
                medium=MEDIUM_GPU,
                lora_name=lora[1] if lora is not None else None,
            )
        )

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (contents of free blocks become unreachable)."""
        for h, block in list(self.cached.items()):
            self.block_hashes[block] = None
            if self.ref_counts[block] == 0:
                self.free.move_to_end(block, last=False)
            del self.cached[h]
        if self.enable_kv_cache_events:
            self.kv_events.append(AllBlocksCleared())

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        refs = [0] * self.num_blocks
        for table in self.tables.values():
            for block in table:
                refs[block] += 1
        pinned = [self.ref_counts[b] - refs[b] for b in range(self.num_blocks)]
        assert all(p >= 0 for p in pinned), "a block has fewer references than table entries"
        for block in range(self.num_blocks):
            in_free = block in self.free
            assert in_free == (self.ref_counts[block] == 0), f"block {block} leaked or double-free"
        for h, block in self.cached.items():
            assert self.block_hashes[block] == h, f"hash map and block {block} disagree"


class KVPool:
    """The one preallocated KV tensor, indexed by slot = block id * block_size + offset.

    Layout ``[num_layers, 2 (K, V), num_blocks * block_size, num_kv_heads, head_dim]``: slots
    are flattened so a step's new K/V land with one ``index_copy_`` per layer and attention
    gathers a sequence's blocks with one ``index_select``.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        num_slots = num_blocks * spec.block_size
        shape = (spec.num_layers, 2, num_slots, spec.num_kv_heads, spec.head_dim)
        self.data = torch.zeros(shape, dtype=spec.storage_dtype)
        self.scales: torch.Tensor | None = (
            torch.ones(shape[:-1], dtype=torch.float32) if spec.quantized else None
        )

    @property
    def nbytes(self) -> int:
        total = self.data.element_size() * self.data.numel()
        if self.scales is not None:
            total += self.scales.element_size() * self.scales.numel()
        return total

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [n, kv_heads, head_dim] of n tokens at ``slots`` [n]."""
        if self.scales is None:
            self.data[layer, 0].index_copy_(0, slots, k.to(self.data.dtype))
            self.data[layer, 1].index_copy_(0, slots, v.to(self.data.dtype))
            return
        for i, x in enumerate((k, v)):
            q, scale = quantize_int8(x)
            self.data[layer, i].index_copy_(0, slots, q)
            self.scales[layer, i].index_copy_(0, slots, scale)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [*slots.shape, kv_heads, head_dim] at ``slots``, dequantized."""
        flat = slots.reshape(-1)
        out: list[torch.Tensor] = []
        for i in range(2):
            x = self.data[layer, i].index_select(0, flat)
            if self.scales is not None:
                scale = self.scales[layer, i].index_select(0, flat)
                x = dequantize_int8(x, scale, self.spec.dtype)
            out.append(x.view(*slots.shape, *x.shape[1:]))
        return out[0], out[1]

    def _block_slots(self, blocks: Sequence[int]) -> torch.Tensor:
        bs = self.spec.block_size
        ids = torch.tensor(list(blocks), dtype=torch.long)
        return (ids[:, None] * bs + torch.arange(bs)).reshape(-1)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: copy every slot of each ``src`` block into ``dst``."""
        if not pairs:
            return
        src = self._block_slots([s for s, _ in pairs])
        dst = self._block_slots([d for _, d in pairs])
        self.data[:, :, dst] = self.data[:, :, src]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]

    def export_blocks(self, blocks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Contents of ``blocks``: ``[layers, 2, n_blocks, block_size, heads, dim]`` (+ scales)."""
        slots = self._block_slots(blocks)
        n, bs = len(blocks), self.spec.block_size
        data = self.data[:, :, slots].reshape(*self.data.shape[:2], n, bs, *self.data.shape[3:])
        scales = None
        if self.scales is not None:
            scales = self.scales[:, :, slots].reshape(*self.scales.shape[:2], n, bs, -1)
        return data.clone(), scales

    def import_blocks(
        self, blocks: Sequence[int], data: torch.Tensor, scales: torch.Tensor | None
    ) -> None:
        """Write exported block contents into ``blocks`` of this pool."""
        slots = self._block_slots(blocks)
        expected = (*self.data.shape[:2], len(blocks), self.spec.block_size, *self.data.shape[3:])
        if tuple(data.shape) != expected or data.dtype != self.data.dtype:
            raise ValueError(
                f"KV blocks of shape {tuple(data.shape)} ({data.dtype}) do not fit this pool, "
                f"which expects {expected} ({self.data.dtype})"
            )
        self.data[:, :, slots] = data.reshape(*self.data.shape[:2], -1, *self.data.shape[3:])
        if self.scales is not None:
            if scales is None:
                raise ValueError("this pool is int8 and needs the exported scales")
            self.scales[:, :, slots] = scales.reshape(*self.scales.shape[:2], -1, scales.shape[-1])


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: returns (int8 values, float32 scale per row)."""
    scale = x.abs().amax(dim=-1).float().clamp_min(1e-8) / 127.0
    q = torch.round(x.float() / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)
