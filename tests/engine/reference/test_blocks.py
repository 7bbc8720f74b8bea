"""The block manager's bookkeeping and the KV pool's tensor operations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetpilot.engine.reference.blocks import (
    BlockManager,
    KVCacheSpec,
    KVPool,
    dequantize_int8,
    extend_block_hashes,
    hash_block,
    quantize_int8,
)
from fleetpilot.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def hashes_of(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BS)
    return out


def test_block_hash_is_chained_over_the_whole_prefix() -> None:
    """Equal blocks after different prefixes must not share a hash (else wrong KV is reused)."""
    a = hashes_of([1, 2, 3, 4, 9, 9, 9, 9])
    b = hashes_of([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[1] != b[1]
    assert hashes_of([1, 2, 3, 4, 9, 9, 9, 9, 7]) == a  # a partial block gets no hash
    assert hash_block(None, [1, 2, 3, 4]) == a[0]


def test_budget_sizing_counts_layers_heads_dim_dtype_and_k_and_v() -> None:
    """bytes per block = 2 (K,V) x layers x kv_heads x head_dim x dtype size x block size."""
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16)
    assert spec.bytes_per_block == 2 * 3 * 2 * 8 * 4 * 16
    assert spec.num_blocks_for_budget(spec.bytes_per_block * 10 + 1) == 10
    q = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, quantized=True)
    # int8 values plus a float32 scale per (token, head, K/V, layer)
    assert q.bytes_per_block == 2 * 3 * 2 * (8 * 1 + 4) * 16
    pool = KVPool(spec, 10)
    assert pool.nbytes == spec.bytes_per_block * 10


def admit(bm: BlockManager, seq: str, tokens: list[int]) -> int:
    """Admit a sequence the way the scheduler does; returns its cached-token count."""
    hashes = hashes_of(tokens)
    hits = bm.match_prefix(hashes, len(tokens) - 1)
    assert bm.allocate(seq, len(tokens), write_from=len(hits) * BS, hit_blocks=hits) == []
    bm.cache_full_blocks(seq, hashes, len(tokens))
    return len(hits) * BS


def test_identical_prefixes_share_physical_blocks_with_ref_counts() -> None:
    """A second request with the same prefix maps its full blocks onto the first's blocks."""
    bm = BlockManager(16, BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert admit(bm, "a", prompt) == 0
    assert admit(bm, "b", prompt) == 8
    ta, tb = bm.table("a"), bm.table("b")
    assert ta[:2] == tb[:2]
    assert ta[2] != tb[2]
    assert [bm.ref_counts[b] for b in ta] == [2, 2, 1]
    assert bm.num_free_blocks == 16 - 4
    bm.free_seq("a")
    assert [bm.ref_counts[b] for b in tb] == [1, 1, 1]
    bm.check_invariants()


def test_whole_prompt_hit_still_leaves_the_last_token_to_compute() -> None:
    """A fully cached prompt reuses all but the block holding its last token (logits needed)."""
    bm = BlockManager(16, BS)
    prompt = list(range(8))
    admit(bm, "a", prompt)
    assert admit(bm, "b", prompt) == 4


def test_freed_cached_blocks_are_reused_on_hit_until_evicted_lru_first() -> None:
    """Freed full blocks stay cached; allocation evicts blocks without a hash first, then LRU."""
    bm = BlockManager(6, BS)
    admit(bm, "a", [1] * 9)  # blocks: 2 full (cached) + 1 partial
    bm.free_seq("a")
    admit(bm, "b", [2] * 9)
    bm.free_seq("b")
    assert bm.num_free_blocks == 6
    assert len(bm.cached) == 4
    # Re-admitting "a"'s prompt hits both its blocks although they were free.
    assert admit(bm, "a2", [1] * 9) == 8
    bm.free_seq("a2")
    # "b" was freed before "a2", so its blocks are older in the LRU: a 4-block request that
    # must evict two cached blocks takes b's (tail block first), keeping a's prefix.
    bm.allocate("c", 16, write_from=0)
    assert len(bm.match_prefix(hashes_of([1] * 9), 8)) == 2
    assert len(bm.match_prefix(hashes_of([2] * 9), 8)) == 0
    assert bm.stats.evictions == 2
    bm.check_invariants()


def test_copy_on_write_when_a_shared_block_is_appended_to() -> None:
    """After fork, the first write into the shared partial block copies it; full blocks stay
    shared."""
    bm = BlockManager(8, BS)
    bm.allocate("p", 6, write_from=0)
    bm.fork("p", "c")
    shared_full, shared_partial = bm.table("p")
    assert bm.ref_counts[shared_partial] == 2
    copies = bm.allocate("c", 7, write_from=6)
    assert copies is not None
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == shared_partial
    assert bm.table("c") == [shared_full, dst]
    assert bm.ref_counts[shared_partial] == 1
    assert bm.ref_counts[shared_full] == 2
    # The parent is now the only owner of its partial block: writing it copies nothing.
    assert bm.allocate("p", 7, write_from=6) == []
    bm.check_invariants()


def test_allocation_failure_changes_nothing() -> None:
    """When blocks run out, allocate returns None and leaves all state as it was."""
    bm = BlockManager(3, BS)
    bm.allocate("a", 8, write_from=0)
    before = (list(bm.ref_counts), list(bm.free), dict(bm.tables))
    assert bm.allocate("b", 8, write_from=0) is None
    assert (list(bm.ref_counts), list(bm.free), dict(bm.tables)) == before


def test_contiguous_baseline_reserves_max_model_len_up_front() -> None:
    """The benchmark baseline commits a whole max_model_len buffer at a request's first step."""
    bm = BlockManager(16, BS, reserve_tokens=32)
    bm.allocate("a", 5, write_from=0)
    assert len(bm.table("a")) == 8
    bm.allocate("a", 30, write_from=5)
    assert len(bm.table("a")) == 8


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["grow", "fork", "free", "admit", "reset"]),
            st.integers(0, 4),
            st.integers(1, 12),
        ),
        max_size=40,
    )
)
def test_pool_never_leaks_blocks_under_random_operations(ops: list[tuple[str, int, int]]) -> None:
    """Any sequence of admits, growths, forks and frees keeps every block accounted for, and
    freeing everything returns the whole pool."""
    bm = BlockManager(10, BS)
    lengths: dict[str, int] = {}
    for op, n, amount in ops:
        seq = f"s{n}"
        if op == "grow" and seq in lengths:
            new_len = lengths[seq] + amount
            if bm.allocate(seq, new_len, write_from=lengths[seq]) is not None:
                lengths[seq] = new_len
                bm.cache_full_blocks(seq, hashes_of([n] * new_len), new_len)
        elif op == "fork" and seq in lengths:
            child = f"s{(n + 1) % 5}"
            if child not in lengths:
                bm.fork(seq, child)
                lengths[child] = lengths[seq]
        elif op == "free":
            bm.free_seq(seq)
            lengths.pop(seq, None)
        elif op == "admit" and seq not in lengths:
            tokens = [amount % 3] * (amount + 1)
            hashes = hashes_of(tokens)
            hits = bm.match_prefix(hashes, len(tokens) - 1)
            if (
                bm.allocate(seq, len(tokens), write_from=len(hits) * BS, hit_blocks=hits)
                is not None
            ):
                lengths[seq] = len(tokens)
                bm.cache_full_blocks(seq, hashes, len(tokens))
        elif op == "reset":
            bm.reset_prefix_cache()
        bm.check_invariants()
        for s, length in lengths.items():
            assert len(bm.table(s)) == -(-length // BS)
    for s in list(lengths):
        bm.free_seq(s)
    bm.check_invariants()
    assert bm.num_free_blocks == 10
    assert all(r == 0 for r in bm.ref_counts)


def test_pool_write_read_copy_export_import_round_trip() -> None:
    """K/V written at slots read back; copy_blocks and export->import move whole blocks."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=BS)
    pool = KVPool(spec, 6)
    torch.manual_seed(0)
    k, v = torch.randn(8, 2, 4), torch.randn(8, 2, 4)
    slots = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])  # blocks 1 and 3
    pool.write(1, slots, k, v)
    rk, rv = pool.read(1, slots)
    assert torch.equal(rk, k)
    assert torch.equal(rv, v)
    pool.copy_blocks([(3, 0)])
    assert torch.equal(pool.read(1, torch.arange(0, 4))[0], k[4:])
    data, scales = pool.export_blocks([1, 3])
    other = KVPool(spec, 6)
    other.import_blocks([5, 2], data, scales)
    assert torch.equal(other.read(1, torch.tensor([20, 21, 22, 23, 8, 9, 10, 11]))[1], v)
    with pytest.raises(ValueError, match="do not fit"):
        KVPool(KVCacheSpec(2, 1, 4, BS), 6).import_blocks([0, 1], data, scales)


def test_int8_quantization_is_per_token_and_close() -> None:
    """int8 KV with a per-(token, head) scale reconstructs within half a quantization step."""
    torch.manual_seed(0)
    x = torch.randn(16, 2, 32) * torch.logspace(-2, 2, 16)[:, None, None]
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8
    assert scale.shape == (16, 2)
    err = (dequantize_int8(q, scale, torch.float32) - x).abs()
    assert torch.all(err <= scale[..., None] / 2 + 1e-6)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=32, block_size=BS, quantized=True)
    pool = KVPool(spec, 4)
    pool.write(0, torch.arange(16), x, -x)
    rk, rv = pool.read(0, torch.arange(16))
    bound = scale[..., None] / 2 + 1e-6
    assert torch.all((rk - x).abs() <= bound)
    assert torch.all((rv + x).abs() <= bound)


# ---- KV events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared) ----------------------


def events_manager(num_blocks: int) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_kv_cache_events=True)


def cache(bm: BlockManager, seq: str, tokens: list[int]) -> None:
    """Admit (or grow) ``seq`` to ``tokens`` and publish its full blocks, as the engine does."""
    hashes = hashes_of(tokens)
    if seq not in bm.tables:
        hits = bm.match_prefix(hashes, len(tokens) - 1)
        assert bm.allocate(seq, len(tokens), write_from=len(hits) * BS, hit_blocks=hits) == []
    else:
        assert bm.allocate(seq, len(tokens), write_from=len(bm.table(seq)) * BS) is not None
    bm.cache_full_blocks(seq, hashes, len(tokens), tokens)


def chain_of(event: BlockStored) -> list[bytes]:
    """Recompute an event's block hashes from its parent and token ids, as a consumer would."""
    parent = event.parent_block_hash
    assert parent is None or isinstance(parent, bytes)
    out: list[bytes] = []
    for i in range(len(event.block_hashes)):
        parent = hash_block(parent, event.token_ids[i * BS : (i + 1) * BS])
        out.append(parent)
    return out


def test_block_stored_carries_consecutive_blocks_parent_and_their_tokens() -> None:
    """vLLM's BlockStored shape: the new full blocks of one sequence in one event, the parent
    None at the start of a prompt and the previous block's hash when the sequence grows, and
    exactly those blocks' token ids (a partial block is not stored)."""
    bm = events_manager(10)
    tokens = list(range(1, 15))  # 3 full blocks and 2 tokens
    cache(bm, "a", tokens)
    hashes = hashes_of(tokens)
    assert bm.take_events() == [
        BlockStored(
            block_hashes=hashes[:3],
            parent_block_hash=None,
            token_ids=tokens[:12],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
    ]
    assert bm.take_events() == []  # taken once
    grown = [*tokens, 15, 16, 17]  # block 3 fills up
    cache(bm, "a", grown)
    (event,) = bm.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == hashes_of(grown)[3:4]
    assert event.parent_block_hash == hashes[2]
    assert event.token_ids == grown[12:16]
    assert chain_of(event) == event.block_hashes


def test_a_prefix_hit_stores_only_the_blocks_after_the_cached_prefix() -> None:
    """A second prompt sharing the first's prefix adds no BlockStored for the shared blocks;
    its own blocks chain from the last shared one."""
    bm = events_manager(10)
    cache(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.take_events()
    cache(bm, "b", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 7])
    (event,) = bm.take_events()
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == hashes_of([1, 2, 3, 4, 5, 6, 7, 8])[1]
    assert event.token_ids == [0, 0, 0, 0]
    cache(bm, "c", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 7])  # everything cached already
    assert bm.take_events() == []


def test_reusing_a_cached_block_emits_block_removed() -> None:
    """When the allocator takes a free cached block for other contents, consumers must hear
    that the old hash is gone (BlockRemoved with that hash, medium GPU)."""
    bm = events_manager(2)
    cache(bm, "a", [1, 2, 3, 4, 5])
    stored = bm.take_events()
    bm.free_seq("a")
    assert bm.take_events() == []  # freed but still cached: nothing to tell
    cache(bm, "b", [9, 9, 9, 9, 9, 9, 9])  # needs both blocks: evicts a's cached one
    events = bm.take_events()
    assert events[0] == BlockRemoved(block_hashes=hashes_of([1, 2, 3, 4]), medium="GPU")
    assert isinstance(stored[0], BlockStored)
    assert isinstance(events[1], BlockStored)


def test_reset_emits_all_blocks_cleared_and_events_are_off_by_default() -> None:
    """A prefix-cache reset is AllBlocksCleared; a manager without events records nothing
    (nobody would drain the list)."""
    bm = events_manager(4)
    cache(bm, "a", [1, 2, 3, 4, 5])
    bm.take_events()
    bm.reset_prefix_cache()
    assert bm.take_events() == [AllBlocksCleared()]
    quiet = BlockManager(4, BS)
    cache(quiet, "a", [1, 2, 3, 4, 5])
    quiet.reset_prefix_cache()
    assert quiet.kv_events == []


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["grow", "free", "admit", "reset"]),
            st.integers(0, 4),
            st.integers(1, 12),
        ),
        max_size=40,
    )
)
def test_replaying_events_rebuilds_exactly_the_prefix_cache(
    ops: list[tuple[str, int, int]],
) -> None:
    """A consumer that applies every event to a set of hashes always holds exactly the hashes
    the engine can hit, and every BlockStored's token ids recompute its hashes (the router's
    index rests on both)."""
    bm = events_manager(8)
    tokens_of: dict[str, list[int]] = {}
    mirror: set[bytes] = set()
    for op, n, amount in ops:
        seq = f"s{n}"
        if op == "grow" and seq in tokens_of:
            grown = tokens_of[seq] + [n] * amount
            if bm.allocate(seq, len(grown), write_from=len(tokens_of[seq])) is not None:
                tokens_of[seq] = grown
                bm.cache_full_blocks(seq, hashes_of(grown), len(grown), grown)
        elif op == "free":
            bm.free_seq(seq)
            tokens_of.pop(seq, None)
        elif op == "admit" and seq not in tokens_of:
            tokens = [amount % 3] * (amount + 1)
            hashes = hashes_of(tokens)
            hits = bm.match_prefix(hashes, len(tokens) - 1)
            if (
                bm.allocate(seq, len(tokens), write_from=len(hits) * BS, hit_blocks=hits)
                is not None
            ):
                tokens_of[seq] = tokens
                bm.cache_full_blocks(seq, hashes, len(tokens), tokens)
        elif op == "reset":
            bm.reset_prefix_cache()
        for event in bm.take_events():
            if isinstance(event, BlockStored):
                assert chain_of(event) == event.block_hashes
                assert not mirror & set(event.block_hashes), "stored twice without a removal"
                mirror.update(h for h in event.block_hashes if isinstance(h, bytes))
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= mirror
                mirror.difference_update(event.block_hashes)
            else:
                mirror.clear()
        assert mirror == set(bm.cached)
