"""The host tier's bookkeeping (HostTier), its pacing (TransferLink), its sizing and its copies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetpilot.engine.reference.blocks import KVCacheSpec, KVPool
from fleetpilot.engine.reference.offload import (
    PAGE_BYTES,
    BlockMeta,
    HostKVStore,
    HostTier,
    OffloadConfig,
    SizeHistogram,
    TransferLink,
)
from fleetpilot.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def placeholder(block_hash: bytes) -> BlockStored:
    """vLLM's placeholder payload of a block stored to CPU (events.py ``_placeholder_stored``)."""
    return BlockStored(
        block_hashes=[block_hash],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=MEDIUM_CPU,
        lora_name=None,
    )


def positions(n: int) -> list[int]:
    """End-token positions of a request's first ``n`` blocks (4 tokens a block)."""
    return [4 * (i + 1) for i in range(n)]


def stored(tier: HostTier, request_id: str, *ids: int) -> None:
    """``request_id`` stores blocks ``ids`` (its first ones, in prefix order), completed."""
    keys = [key(i) for i in ids]
    result = tier.prepare_store(request_id, keys, positions(len(keys)))
    assert result is not None
    tier.complete_store(result[0])


def test_the_size_in_gib_becomes_whole_page_aligned_blocks_as_vllm_divides_it() -> None:
    """vLLM: cpu_bytes_to_use // round_up(kv bytes per chunk, page); a block of less than a page
    still takes one, and what is left over holds no block."""
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4)  # 3072 bytes
    assert spec.bytes_per_block < PAGE_BYTES
    config = OffloadConfig(capacity_bytes=int(0.5 * (1 << 30)))
    assert OffloadConfig.block_bytes(spec) == PAGE_BYTES
    assert config.num_blocks(spec) == (1 << 29) // PAGE_BYTES
    big = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16)  # 32 KiB
    assert OffloadConfig(capacity_bytes=3 * big.bytes_per_block + 5).num_blocks(big) == 3
    with pytest.raises(ValueError, match="bandwidth"):
        OffloadConfig(capacity_bytes=1, bandwidth_bytes_per_s=0)


def test_a_lookup_counts_the_run_from_the_first_key_and_defers_on_a_block_being_written() -> None:
    """Only consecutive resident blocks count; a block whose store has not completed defers the
    request (vLLM's HIT_PENDING), and so does one another request is loading."""
    tier = HostTier(8)
    stored(tier, "r1", 1, 2, 3)
    assert tier.lookup([key(1), key(2), key(9), key(3)]) == 2
    assert tier.lookup([key(9), key(1)]) == 0
    pending = tier.prepare_store("r2", [key(4)], [4])
    assert pending is not None
    assert pending[0] == [key(4)]
    assert tier.lookup([key(1), key(4)]) is None
    assert tier.lookup([key(1), key(2)]) == 2  # the pending block is past the run asked for
    tier.complete_store([key(4)])
    assert tier.lookup([key(1), key(4)]) == 2
    tier.prepare_load("r3", [key(2)], [8])
    assert tier.lookup([key(1), key(2)]) is None
    tier.complete_load([key(2)])
    assert tier.lookup([key(1), key(2)]) == 2


def test_stores_evict_the_oldest_idle_blocks_and_never_those_offered() -> None:
    """A full tier makes room by evicting the blocks of the oldest request first, each
    request's tail before its head; blocks being loaded and the blocks offered are kept; a
    later request's load makes a block as recent as that request."""
    tier = HostTier(4)
    stored(tier, "r1", 1, 2)
    stored(tier, "r2", 3, 4)
    assert tier.eviction_order() == [key(2), key(1), key(4), key(3)]
    tier.prepare_load("r3", [key(1)], [4])
    assert tier.eviction_order() == [key(2), key(4), key(3)]  # 1 is pinned by the load
    tier.complete_load([key(1)])
    assert tier.eviction_order() == [key(2), key(4), key(3), key(1)]
    # Offered: 3 (resident, kept) and 5, 6 (new): evicts 2 then 4, not 3, not 1.
    result = tier.prepare_store("r4", [key(3), key(5), key(6)], positions(3))
    assert result is not None
    assert result[0] == [key(5), key(6)]
    assert set(tier.entries) == {key(1), key(3), key(5), key(6)}
    assert tier.stats.evictions == 2
    tier.check_invariants()


def test_a_store_that_cannot_evict_enough_changes_nothing_and_counts_a_failure() -> None:
    """Blocks being written or loaded cannot be evicted: the store fails whole (vLLM's
    allocation failure) and the tier is as it was."""
    tier = HostTier(2)
    tier.prepare_store("r1", [key(1)], [4])  # still being written
    stored(tier, "r2", 2)
    tier.prepare_load("r3", [key(2)], [4])
    before = {k: (e.slot, e.ready, e.loads) for k, e in tier.entries.items()}
    assert tier.prepare_store("r4", [key(3)], [4]) is None
    assert {k: (e.slot, e.ready, e.loads) for k, e in tier.entries.items()} == before
    assert tier.stats.allocation_failures == 1
    assert tier.take_events() == []
    tier.complete_load([key(2)])
    result = tier.prepare_store("r4", [key(3)], [4])
    assert result is not None
    assert result[0] == [key(3)]
    assert key(2) not in tier


def test_a_finished_request_outlives_a_running_one_and_keeps_its_head_longest() -> None:
    """vLLM's LRU policy: when a request finishes, the blocks it used become the newest, tail
    to head; a request still running keeps the rank of its first use, so its blocks (tail
    first) go before those of a request that finished after it started."""
    tier = HostTier(4)
    stored(tier, "running", 1, 2)
    stored(tier, "done", 3, 4)
    tier.finish("done")
    assert tier.eviction_order() == [key(2), key(1), key(4), key(3)]
    tier.finish("running")
    assert tier.eviction_order() == [key(4), key(3), key(2), key(1)]
    tier.finish("running")  # once only
    assert tier.eviction_order() == [key(4), key(3), key(2), key(1)]


def test_events_carry_medium_cpu_removed_when_evicted_stored_when_complete() -> None:
    """Placeholder payloads (vLLM's default): a BlockStored per block with only its hash and
    block_size 0; one BlockRemoved for the blocks one store evicted; in the order they
    happened; none when events are off."""
    tier = HostTier(2, enable_kv_cache_events=True)
    result = tier.prepare_store("r1", [key(1), key(2)], positions(2))
    assert result is not None
    assert tier.take_events() == []  # not servable yet
    tier.complete_store([key(1), key(2)])
    evicting = tier.prepare_store("r2", [key(3), key(4)], positions(2))
    assert evicting is not None
    tier.complete_store([key(3)])
    events = tier.take_events()
    assert events == [
        placeholder(key(1)),
        placeholder(key(2)),
        BlockRemoved(block_hashes=[key(2), key(1)], medium=MEDIUM_CPU),  # tail first
        placeholder(key(3)),
    ]
    assert tier.take_events() == []
    quiet = HostTier(1)
    stored(quiet, "r1", 1)
    stored(quiet, "r2", 2)
    assert quiet.take_events() == []


def test_self_describing_events_carry_the_blocks_parent_tokens_size_and_adapter() -> None:
    """With self_describing_kv_events, each stored block says what a consumer needs to chain
    it (as vLLM's tracker: parent hash, token ids, block size, LoRA id and name); its removal
    names its hash. Events off, the setting gives no payload to keep."""
    tier = HostTier(1, enable_kv_cache_events=True, self_describing_kv_events=True)
    meta = BlockMeta(parent=key(0), token_ids=(5, 6, 7, 8), block_size=4, lora=(3, "sql"))
    result = tier.prepare_store("r1", [key(1)], [8], [meta])
    assert result is not None
    tier.complete_store([key(1)])
    stored(tier, "r2", 2)  # no description given: the placeholder
    assert tier.take_events() == [
        BlockStored(block_hashes=[key(1)], parent_block_hash=key(0), token_ids=[5, 6, 7, 8],
                    block_size=4, lora_id=3, medium=MEDIUM_CPU, lora_name="sql"),
        BlockRemoved(block_hashes=[key(1)], medium=MEDIUM_CPU),
        placeholder(key(2)),
    ]  # fmt: skip
    assert tier._meta == {}  # the removed block's payload is gone
    off = HostTier(1, self_describing_kv_events=True)
    assert off.prepare_store("r1", [key(1)], [8], [meta]) is not None
    assert off._meta == {}


def test_a_reset_empties_the_tier_without_events() -> None:
    """vLLM's reset_cache drops every chunk and emits nothing."""
    tier = HostTier(3, enable_kv_cache_events=True)
    stored(tier, "r1", 1, 2)
    tier.take_events()
    tier.reset()
    assert tier.num_used == 0
    assert tier.take_events() == []
    tier.finish("r1")  # its uses are forgotten too
    tier.check_invariants()
    stored(tier, "r2", 3, 4, 5)
    tier.check_invariants()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "complete_store", "load", "complete_load", "finish", "reset"]),
        st.integers(0, 3),  # the request
        st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_random_operations_keep_the_bookkeeping_whole(
    ops: list[tuple[str, int, list[int]]],
) -> None:
    """Under any sequence: slots are never shared or leaked, a failed store changes nothing,
    loads pin what they read, evictions take idle blocks in recency order, and the usage
    figures stay within the tier."""
    tier = HostTier(5, enable_kv_cache_events=True)
    loads: list[list[bytes]] = []
    for op, request, ids in ops:
        rid = f"r{request}"
        keys = [key(i) for i in ids]
        where = [4 * (i + 1) for i in ids]  # block i of every request has the same tokens
        if op == "store":
            before = {k: (e.slot, e.ready, e.loads) for k, e in tier.entries.items()}
            order = tier.eviction_order()
            result = tier.prepare_store(rid, keys, where)
            after = {k: (e.slot, e.ready, e.loads) for k, e in tier.entries.items()}
            if result is None:
                assert after == before
            else:
                assert all(k in tier for k in keys)
                assert all(k not in before for k in result[0])
                assert all(v == after[k] for k, v in before.items() if k in keys)
                gone = [k for k in order if k not in tier]
                assert gone == [k for k in order if k not in keys][: len(gone)], "not LRU"
        elif op == "complete_store":
            tier.complete_store(keys)
        elif op == "load":
            run = tier.lookup(keys)
            if run:
                loads.append(keys[:run])
                tier.prepare_load(rid, keys[:run], where[:run])
        elif op == "complete_load" and loads:
            tier.complete_load(loads.pop(0))
        elif op == "finish":
            tier.finish(rid)
        elif op == "reset":
            tier.reset()
            loads.clear()
        tier.check_invariants()
        assert 0 <= tier.num_writing <= tier.num_pinned <= tier.num_used <= tier.num_blocks
        pinned = {k for batch in loads for k in batch}
        assert all(tier.entries[k].loads > 0 for k in pinned)
        for event in tier.take_events():
            assert isinstance(event, BlockStored | BlockRemoved)
            assert event.medium == MEDIUM_CPU
            if isinstance(event, BlockRemoved):
                assert not set(event.block_hashes) & pinned, "evicted while being loaded"


def test_a_link_runs_its_transfers_one_after_another_at_its_bandwidth() -> None:
    """A transfer takes bytes / bandwidth; one issued while another runs starts when it ends."""
    link = TransferLink(bandwidth_bytes_per_s=1000.0)
    assert link.schedule(10.0, 500) == (10.0, 10.5)
    assert link.schedule(10.1, 1000) == (10.5, 11.5)
    assert link.schedule(20.0, 100) == (20.0, 20.1)


def test_the_store_copies_blocks_out_and_the_load_copies_them_into_other_blocks() -> None:
    """A block stored from one place of the device pool and loaded into another is equal, and
    int8 pools carry their scales along."""
    for quantized in (False, True):
        spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4,
                           quantized=quantized)  # fmt: skip
        device = KVPool(spec, 6)
        torch.manual_seed(0)
        for layer in range(2):
            k = torch.randn(24, 2, 4)
            device.write(layer, torch.arange(24), k, -k)
        host = HostKVStore(spec, 3)
        host.store(device, [4, 1], [2, 0])
        original = device.export_blocks([4, 1])
        host.load(device, [2, 0], [0, 5])
        copied = device.export_blocks([0, 5])
        assert torch.equal(copied[0], original[0])
        if quantized:
            assert copied[1] is not None
            assert original[1] is not None
            assert torch.equal(copied[1], original[1])


def test_a_size_histogram_counts_cumulatively_as_prometheus_does() -> None:
    h = SizeHistogram((1.0, 4.0, 16.0))
    for value in (1, 3, 4, 100):
        h.observe(value)
    assert (h.counts, h.count, h.sum) == ([1, 3, 3], 4, 108.0)
    snapshot = h.copy()
    h.observe(2)
    assert snapshot.counts == [1, 3, 3]
