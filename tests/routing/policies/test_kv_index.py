"""The KV-event index: block content -> replicas, built from BlockStored/BlockRemoved/
AllBlocksCleared, matched by a request's token ids, bounded by an LRU."""

from __future__ import annotations

import random
from hashlib import blake2b
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetpilot.api.router_config import HostBlocks
from fleetpilot.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
)
from fleetpilot.routing.policies.kv_index import MAX_ALIASES, ROOT, KVIndex, chain_keys

BS = 4


def stored(
    hashes: list[BlockHash],
    tokens: list[int],
    parent: BlockHash | None = None,
    *,
    block_size: int = BS,
    lora: str | None = None,
    medium: str | None = "GPU",
) -> BlockStored:
    return BlockStored(hashes, parent, tokens, block_size, None, medium, lora)


PROMPT = list(range(100, 116))  # 4 blocks of 4


def test_stored_blocks_match_and_removed_or_cleared_ones_do_not() -> None:
    """A replica's stored blocks match a request sharing them; a removal or a clear of that
    replica takes them back, and nothing of another replica is touched."""
    index = KVIndex()
    index.apply("a", [stored([1, 2, 3, 4], PROMPT)])
    index.apply("b", [stored([9], PROMPT[:4])])
    assert index.match([*PROMPT, 7, 7], BS) == {"a": 4, "b": 1}
    index.apply("a", [BlockRemoved([4], "GPU")])
    assert index.match(PROMPT, BS) == {"a": 3, "b": 1}
    index.apply("a", [AllBlocksCleared()])
    assert index.match(PROMPT, BS) == {"b": 1}
    assert index.blocks == 1
    assert index.replica_blocks("a") == 0


def test_a_chain_continues_across_events_through_the_parent_hash() -> None:
    """A second BlockStored whose parent is the last block of the first extends the same
    chain: the request matches all blocks of both (a long prompt cached in two steps)."""
    index = KVIndex()
    index.apply("a", [stored([b"h1", b"h2"], PROMPT[:8])])
    index.apply("a", [stored([b"h3", b"h4"], PROMPT[8:], parent=b"h2")])
    assert index.match(PROMPT, BS) == {"a": 4}
    assert index.block_size("a") == BS


def test_a_child_whose_parent_was_never_seen_is_skipped_and_counted() -> None:
    """Events missed before the subscription leave a parent hash unknown: its children
    cannot be chained, so they are counted, not guessed."""
    index = KVIndex()
    applied = index.apply("a", [stored([3, 4], PROMPT[8:], parent=2)])
    assert applied.unknown_parent_blocks == 2
    assert index.stats.unknown_parent_blocks == 2
    assert index.match(PROMPT, BS) == {}
    assert len(index) == 0


def test_two_replicas_with_different_engine_hashes_share_one_content_key() -> None:
    """Engines hash blocks their own way (a vLLM and a reference engine, or two vLLM
    processes with different seeds): the same prefix on both still matches on both."""
    index = KVIndex()
    index.apply("vllm", [stored([b"\x01" * 32, b"\x02" * 32], PROMPT[:8])])
    index.apply("ref", [stored([11, 12, 13], PROMPT[:12])])
    assert index.match(PROMPT, BS) == {"vllm": 2, "ref": 3}
    assert len(index) == 3
    assert index.blocks == 5


def test_a_removed_middle_block_cuts_the_match_there() -> None:
    """An engine evicting block 1 of 4 can serve only block 0 from cache: the match stops
    at the hole even though blocks 2 and 3 are still listed."""
    index = KVIndex()
    index.apply("a", [stored([1, 2, 3, 4], PROMPT)])
    index.apply("a", [BlockRemoved([2], "GPU")])
    assert index.match(PROMPT, BS) == {"a": 1}


def test_lora_name_and_block_size_keep_keys_apart() -> None:
    """The same tokens under another LoRA adapter or another block size are another cache
    entry on the engine, so they must not match."""
    index = KVIndex()
    index.apply("a", [stored([1, 2], PROMPT[:8], lora="sql")])
    index.apply("b", [stored([1], PROMPT[:8], block_size=8)])
    assert index.match(PROMPT, BS) == {}
    assert index.match(PROMPT, BS, "sql") == {"a": 2}
    assert index.match(PROMPT, BS, "chat") == {}
    assert index.match(PROMPT, 8) == {"b": 1}
    assert chain_keys(PROMPT, BS, None) != chain_keys(PROMPT, BS, "")


def test_the_longest_leading_run_counts_per_replica() -> None:
    """Replicas diverging after a shared head each get the length of their own run."""
    index = KVIndex()
    other = PROMPT[:8] + [5] * 8
    index.apply("a", [stored([1, 2, 3, 4], PROMPT)])
    index.apply("b", [stored([1, 2, 3, 4], other)])
    index.apply("c", [stored([1], PROMPT[:4])])
    assert index.match(PROMPT, BS) == {"a": 4, "b": 2, "c": 1}
    assert index.match(other, BS) == {"a": 2, "b": 4, "c": 1}


def test_a_departed_replica_is_dropped_and_its_slot_reused() -> None:
    """A replica that left (scaled in, restarted under a new address) matches nothing, and a
    newcomer taking its bitmask slot does not inherit its blocks."""
    index = KVIndex()
    index.apply("a", [stored([1, 2], PROMPT[:8])])
    index.apply("b", [stored([1], PROMPT[:4])])
    index.retain(["b"])
    assert index.replicas() == ["b"]
    index.apply("c", [stored([7], [1, 2, 3, 4])])
    assert index.match(PROMPT, BS) == {"b": 1}
    assert index.match([1, 2, 3, 4], BS) == {"c": 1}


def test_restoring_a_known_block_is_idempotent() -> None:
    """vLLM re-announces prefix-cache hits as BlockStored: repeating a store must not count
    the block twice, and one removal still removes it."""
    index = KVIndex()
    for _ in range(3):
        index.apply("a", [stored([1, 2], PROMPT[:8])])
    assert index.blocks == 2
    index.apply("a", [BlockRemoved([1, 2], "GPU")])
    assert index.blocks == 0
    assert len(index) == 0


def test_aliases_of_one_content_key_hold_it_until_the_last_is_removed() -> None:
    """Two engine blocks with the same tokens (a cache_salt the content key does not see)
    keep the replica on the key until both are gone."""
    index = KVIndex()
    index.apply("a", [stored([1], PROMPT[:4]), stored([2], PROMPT[:4])])
    index.apply("a", [BlockRemoved([1], "GPU")])
    assert index.match(PROMPT, BS) == {"a": 1}
    index.apply("a", [BlockRemoved([2], "GPU")])
    assert index.match(PROMPT, BS) == {}


def test_inconsistent_and_storage_tier_events_are_not_indexed() -> None:
    """A BlockStored whose token count does not fill its blocks, or with a token id beyond 32
    bits, is counted invalid; STORAGE-tier events (disk, far slower than host memory) are
    counted and ignored, their removals too."""
    index = KVIndex()
    applied = index.apply(
        "a",
        [
            stored([1, 2], PROMPT[:7]),
            stored([1], [2**40, 0, 0, 0]),
            stored([1], PROMPT[:4], block_size=0),
            stored([1], PROMPT[:4], medium=MEDIUM_STORAGE),
            BlockRemoved([1], MEDIUM_STORAGE),
        ],
    )
    assert (applied.events, applied.invalid_events) == (5, 3)
    assert index.stats.other_medium_events == 2
    assert index.blocks == 0


def test_the_lru_evicts_least_recently_stored_or_matched_keys_first() -> None:
    """A matched prefix survives a flood that evicts an unmatched one stored after it."""
    index = KVIndex(max_blocks=8)
    hot, cold = [1] * 16, [2] * 16
    index.apply("a", [stored([1, 2, 3, 4], hot)])
    index.apply("a", [stored([5, 6, 7, 8], cold)])
    assert index.match(hot, BS) == {"a": 4}  # hot is now the most recent
    index.apply("a", [stored([9, 10], [3] * 8)])
    assert index.blocks == 8
    assert index.match(hot, BS) == {"a": 4}
    assert index.match(cold, BS) == {"a": 2}  # the cold chain lost its tail first


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 200), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_a_flood_of_random_blocks_never_grows_past_the_bound(
    bound: int, replicas: int, seed: int
) -> None:
    """However many random blocks engines announce (a misbehaving or hostile publisher), the
    index holds at most ``max_blocks`` entries, and its maps stay consistent."""
    rng = random.Random(seed)
    index = KVIndex(max_blocks=bound)
    parents: dict[str, list[int]] = {f"r{i}": [] for i in range(replicas)}
    for n in range(300):
        rid = f"r{rng.randrange(replicas)}"
        blocks = rng.randint(1, 6)
        parent = rng.choice(parents[rid]) if parents[rid] and rng.random() < 0.5 else None
        hashes = [rng.getrandbits(64) for _ in range(blocks)]
        tokens = [rng.randrange(1000) for _ in range(blocks * BS)]
        index.apply(rid, [stored(list(hashes), tokens, parent)])
        parents[rid].extend(hashes)
        if n % 50 == 49:
            index.apply(rid, [BlockRemoved(rng.sample(parents[rid], 3), "GPU")])
        assert index.blocks <= bound
    assert len(index) <= index.blocks == sum(index.replica_blocks(r) for r in index.replicas())


def test_chain_keys_are_stable_and_only_full_blocks_count() -> None:
    """Keys are the same in every process (every router replica must agree), cover only full
    blocks, and a bad block size is refused."""
    assert len(chain_keys(list(range(9)), 4)) == 2
    tokens = b"".join(t.to_bytes(4, "little") for t in (1, 2, 3, 4))
    no_lora = b"\xff" * 4
    first = blake2b(ROOT + (4).to_bytes(4, "little") + no_lora + tokens, digest_size=16)
    assert chain_keys([1, 2, 3, 4], 4) == [first.digest()]
    assert first.hexdigest() == "0f731fdc1a733926c0f35e0194e92227"
    with pytest.raises(ValueError, match="block_size"):
        chain_keys([1], 0)


def test_eviction_pressure_rises_only_while_stores_displace_cached_blocks() -> None:
    """A replica that only stores (its cache still has room) has no pressure; one whose every
    stored block comes with a removal (a full cache evicting) nears 1; a clear (an empty cache)
    resets it, and an unknown replica has none."""
    index = KVIndex()
    filling = [stored([i], [i, i, i, i]) for i in range(1, 400)]
    index.apply("a", filling)
    assert index.eviction_pressure("a") == 0.0
    for i in range(400, 1000):
        index.apply("a", [stored([i], [i, i, i, i]), BlockRemoved([i - 399], "GPU")])
    assert index.eviction_pressure("a") > 0.95
    for i in range(1000, 1256):  # room again: stores without removals
        index.apply("a", [stored([i], [i, i, i, i])])
    assert 0.2 < index.eviction_pressure("a") < 0.8
    index.apply("a", [AllBlocksCleared()])
    assert index.eviction_pressure("a") == 0.0
    assert index.eviction_pressure("never-seen") == 0.0


# ---- two media: the device pool and the host tier (KV offloading, issue 46) ----------------


def written_through(
    hashes: list[BlockHash], tokens: list[int], parent: BlockHash | None = None
) -> list[Event]:
    """What an offloading vLLM publishes for computed prompt blocks: the device store, then the
    host tier's (self-describing) store of the same blocks once its copy completes."""
    return [
        stored(hashes, tokens, parent, medium=MEDIUM_GPU),
        stored(hashes, tokens, parent, medium=MEDIUM_CPU),
    ]


def tiers(index: KVIndex, tokens: list[int]) -> tuple[dict[str, int], dict[str, int]]:
    match = index.match_tiers(chain_keys(tokens, BS))
    return match.blocks, match.host


def test_a_block_the_device_evicted_but_host_memory_keeps_is_a_host_hit() -> None:
    """Written through to host memory, a prompt is a device hit; once the device evicts its
    tail the tail is a host hit (loaded, not recomputed); once the host tier evicts it too it
    is a miss, and the index forgets the block."""
    index = KVIndex()
    index.apply("a", written_through([1, 2, 3, 4], PROMPT))
    assert tiers(index, PROMPT) == ({"a": 4}, {})
    assert index.blocks == 4  # a block on both media is one entry
    index.apply("a", [BlockRemoved([3, 4], MEDIUM_GPU)])
    assert tiers(index, PROMPT) == ({"a": 4}, {"a": 2})
    assert index.match(PROMPT, BS) == {"a": 4}  # what the engine will not recompute
    index.apply("a", [BlockRemoved([4], MEDIUM_CPU)])
    assert tiers(index, PROMPT) == ({"a": 3}, {"a": 1})
    assert index.blocks == 3
    index.apply("a", [BlockRemoved([3], MEDIUM_CPU)])
    assert tiers(index, PROMPT) == ({"a": 2}, {})
    assert index.blocks == 2
    assert index.host_blocks_of("a") == 2


def test_the_host_run_starts_where_the_device_prefix_ends_and_needs_host_copies() -> None:
    """vLLM's connector looks blocks up in host memory only from where the device prefix
    ends: a block on both media there counts as host, and a device-only block after it ends
    the run (the engine recomputes it). A replica whose device holds nothing of the prompt
    matches from its first block, all of it host."""
    index = KVIndex()
    index.apply("a", [stored([1, 2, 3, 4], PROMPT, medium=MEDIUM_GPU)])
    index.apply("a", [stored([1, 2], PROMPT[:8], medium=MEDIUM_CPU)])
    index.apply("a", [BlockRemoved([1], MEDIUM_GPU)])
    # Block 0 host only, block 1 on both (after the hole: host), blocks 2-3 device only.
    assert tiers(index, PROMPT) == ({"a": 2}, {"a": 2})
    index.apply("b", [stored([7, 8, 9], PROMPT[:12], medium=MEDIUM_CPU)])
    assert tiers(index, PROMPT) == ({"a": 2, "b": 3}, {"a": 2, "b": 3})
    assert index.holds("b", chain_keys(PROMPT, BS)[0], MEDIUM_CPU)
    assert not index.holds("b", chain_keys(PROMPT, BS)[0], MEDIUM_GPU)


def test_replicas_diverge_by_medium_in_one_match() -> None:
    """Several replicas in one match, each with its own device prefix and host run: a device
    replica, a host replica and one switching media midway are told apart, and the device
    replica's match outlives the others'."""
    index = KVIndex()
    index.apply("dev", [stored([1, 2, 3, 4], PROMPT, medium=MEDIUM_GPU)])
    index.apply("host", [stored([1, 2], PROMPT[:8], medium=MEDIUM_CPU)])
    index.apply("mixed", written_through([1, 2, 3], PROMPT[:12]))
    index.apply("mixed", [BlockRemoved([2, 3], MEDIUM_GPU)])
    assert tiers(index, PROMPT) == (
        {"dev": 4, "host": 2, "mixed": 3},
        {"host": 2, "mixed": 2},
    )


def test_hashes_re_announced_by_overlapping_chunks_stay_until_every_chunk_is_removed() -> None:
    """vLLM offloads chunks of blocks; two prompts sharing a prefix that ends mid-chunk store
    two chunks holding the shared block, so its hash is announced (and later removed) once per
    chunk. Host copies are reference-counted: the first chunk's eviction leaves the block in
    host memory (held by the other chunk), the second's takes it."""
    index = KVIndex()
    first = PROMPT  # blocks a0 a1 | a2 a3, chunks of 2 blocks
    second = [*PROMPT[:12], 9, 9, 9, 9]  # a0 a1 | a2 b3: shares a2 with the first's chunk 1
    index.apply("a", [stored([10, 11], first[:8], medium=MEDIUM_CPU)])
    index.apply("a", [stored([12, 13], first[8:], 11, medium=MEDIUM_CPU)])
    index.apply("a", [stored([12, 23], second[8:], 11, medium=MEDIUM_CPU)])  # a2 again
    assert tiers(index, second) == ({"a": 4}, {"a": 4})
    index.apply("a", [BlockRemoved([12, 13], MEDIUM_CPU)])  # the first prompt's chunk 1
    assert tiers(index, first) == ({"a": 3}, {"a": 3})
    assert tiers(index, second) == ({"a": 4}, {"a": 4})
    index.apply("a", [BlockRemoved([12, 23], MEDIUM_CPU)])
    assert tiers(index, second) == ({"a": 2}, {"a": 2})
    assert index.blocks == 2
    index.apply("a", [BlockRemoved([12], MEDIUM_CPU)])  # one removal too many: counted
    assert index.stats.unknown_removed == 1


def test_device_stores_repeat_idempotently_while_host_stores_count() -> None:
    """vLLM re-announces a device block on each prefix-cache hit with no removal to match, so
    device stores are not counted: one device removal takes the device copy however often it
    was announced, and the host copy stays."""
    index = KVIndex()
    for _ in range(3):
        index.apply("a", [stored([1, 2], PROMPT[:8], medium=MEDIUM_GPU)])
    index.apply("a", [stored([1, 2], PROMPT[:8], medium=MEDIUM_CPU)])
    index.apply("a", [BlockRemoved([1, 2], MEDIUM_GPU)])
    assert tiers(index, PROMPT) == ({"a": 2}, {"a": 2})
    index.apply("a", [BlockRemoved([1, 2], MEDIUM_CPU)])
    assert tiers(index, PROMPT) == ({}, {})
    assert (index.blocks, len(index)) == (0, 0)


def test_placeholder_host_events_are_counted_and_never_keyed() -> None:
    """Without ``self_describing_kv_events`` vLLM's host tier announces a chunk by one hash
    (the chunk's last block's), no parent, no tokens, block size 0: nothing to key content on.
    It is counted, indexes nothing, and its later removal - naming a hash the device holds -
    takes nothing from the device copy."""
    index = KVIndex()
    index.apply("a", [stored([1, 2], PROMPT[:8], medium=MEDIUM_GPU)])
    placeholder = BlockStored([2], None, [], 0, None, MEDIUM_CPU, None)
    applied = index.apply("a", [placeholder, placeholder])
    assert (applied.placeholder_events, applied.invalid_events) == (2, 0)
    assert index.stats.placeholder_events == 2
    assert index.blocks == 2
    assert index.host_blocks_of("a") == 0
    index.apply("a", [BlockRemoved([2], MEDIUM_CPU)])
    assert tiers(index, PROMPT) == ({"a": 2}, {})
    assert index.stats.unknown_removed == 1


def test_all_blocks_cleared_empties_both_media() -> None:
    """AllBlocksCleared names no medium: the replica's device and host copies all go, and
    a host removal after it finds nothing."""
    index = KVIndex()
    index.apply("a", written_through([1, 2], PROMPT[:8]))
    index.apply("b", [stored([5], PROMPT[:4], medium=MEDIUM_CPU)])
    index.apply("a", [BlockRemoved([2], MEDIUM_GPU), AllBlocksCleared()])
    assert tiers(index, PROMPT) == ({"b": 1}, {"b": 1})
    assert index.replica_blocks("a") == index.host_blocks_of("a") == 0
    index.apply("a", [BlockRemoved([1], MEDIUM_CPU)])
    assert index.stats.unknown_removed == 1
    assert index.blocks == 1


def test_a_host_store_chains_through_a_parent_only_the_device_announced() -> None:
    """A host chunk's parent is an engine hash; the device announced it first (blocks are
    written through as they are computed), so the chunk chains on it."""
    index = KVIndex()
    index.apply("a", [stored([1, 2], PROMPT[:8], medium=MEDIUM_GPU)])
    index.apply("a", [stored([3, 4], PROMPT[8:], 2, medium=MEDIUM_CPU)])
    assert tiers(index, PROMPT) == ({"a": 4}, {"a": 2})


def test_the_medium_blind_and_device_only_readings() -> None:
    """``asDevice`` (medium-blind, the benchmark's middle arm) counts a block on either medium
    as a device hit, so a run continues across a device-only block after a hole; ``ignored``
    drops host events at ingest (counted) and reads none indexed before the switch."""
    events: list[Event] = [
        stored([1, 2, 3, 4], PROMPT, medium=MEDIUM_GPU),
        stored([1, 2], PROMPT[:8], medium=MEDIUM_CPU),
        BlockRemoved([1], MEDIUM_GPU),
    ]
    blind = KVIndex(host_blocks=HostBlocks.AS_DEVICE)
    blind.apply("a", events)
    assert tiers(blind, PROMPT) == ({"a": 4}, {})
    deaf = KVIndex(host_blocks=HostBlocks.IGNORED)
    deaf.apply("a", events)
    assert tiers(deaf, PROMPT) == ({}, {})  # block 0 left the device
    assert deaf.stats.other_medium_events == 1
    assert deaf.blocks == 3
    tiered = KVIndex()
    tiered.apply("a", events)
    tiered.host_blocks = HostBlocks.IGNORED
    assert tiers(tiered, PROMPT) == ({}, {})


def test_host_events_keep_the_eviction_pressure_of_the_device() -> None:
    """The pressure says how hard the device pool evicts; the host tier evicting on its own
    does not move it."""
    index = KVIndex()
    for i in range(1, 300):
        index.apply("a", [stored([i], [i] * BS, medium=MEDIUM_CPU)])
        if i > 10:
            index.apply("a", [BlockRemoved([i - 10], MEDIUM_CPU)])
    assert index.eviction_pressure("a") == 0.0


class Mirror:
    """The obvious model of one replica's cache by medium, for the property test: engine hash
    -> [key, on device, host count], matched block by block."""

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, list[Any]] = {}

    def store(self, event: BlockStored) -> None:
        device = event.medium == MEDIUM_GPU
        parent = ROOT
        if event.parent_block_hash is not None:
            if event.parent_block_hash not in self.blocks:
                return
            parent = self.blocks[event.parent_block_hash][0]
        keys = chain_keys(event.token_ids, BS, parent=parent)
        for engine_hash, key in zip(reversed(event.block_hashes), reversed(keys), strict=True):
            entry = self.blocks.get(engine_hash)
            if entry is not None and entry[0] != key:
                del self.blocks[engine_hash]
                entry = None
            if entry is None:
                aliases = sum(1 for e in self.blocks.values() if e[0] == key)
                if aliases >= MAX_ALIASES:
                    continue
                entry = self.blocks[engine_hash] = [key, False, 0]
            if device:
                entry[1] = True
            else:
                entry[2] += 1

    def remove(self, event: BlockRemoved) -> None:
        for engine_hash in event.block_hashes:
            entry = self.blocks.get(engine_hash)
            if entry is None:
                continue
            if event.medium == MEDIUM_GPU:
                entry[1] = False
            elif entry[2]:
                entry[2] -= 1
            if not entry[1] and not entry[2]:
                del self.blocks[engine_hash]

    def match(self, keys: list[bytes]) -> tuple[int, int]:
        device = host = 0
        for key in keys:
            held = [e for e in self.blocks.values() if e[0] == key]
            if host == 0 and any(e[1] for e in held):
                device += 1
            elif any(e[2] for e in held):
                host += 1
            else:
                break
        return device + host, host


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_events_of_both_media_match_as_a_per_block_model_does(seed: int) -> None:
    """Random stores and removals on both media, over three replicas and a small alphabet (so
    prefixes are shared and hashes re-announced), match every prompt as the obvious per-block
    model of each replica's media does, and the index's counts stay consistent."""
    rng = random.Random(seed)
    index = KVIndex()
    mirrors = {f"r{i}": Mirror() for i in range(3)}
    prompts = [[rng.randrange(3) for _ in range(6 * BS)] for _ in range(4)]
    hashes: list[list[BlockHash]] = [[rng.getrandbits(16) for _ in range(6)] for _ in prompts]
    for _ in range(120):
        rid = rng.choice(list(mirrors))
        p = rng.randrange(len(prompts))
        first = rng.randrange(6)
        last = rng.randrange(first, 6) + 1
        medium = rng.choice([MEDIUM_GPU, MEDIUM_CPU])
        block_hashes = hashes[p][first:last]
        event: BlockStored | BlockRemoved
        if rng.random() < 0.6:
            parent = hashes[p][first - 1] if first else None
            tokens = prompts[p][first * BS : last * BS]
            event = stored(block_hashes, tokens, parent, medium=medium)
            mirrors[rid].store(event)
        else:
            event = BlockRemoved(block_hashes, medium)
            mirrors[rid].remove(event)
        index.apply(rid, [event])
    for prompt in prompts:
        match = index.match_tiers(chain_keys(prompt, BS))
        for rid, mirror in mirrors.items():
            expected = mirror.match(chain_keys(prompt, BS))
            assert (match.blocks.get(rid, 0), match.host.get(rid, 0)) == expected, rid
    assert index.blocks == sum(len(m.blocks) for m in mirrors.values())
    assert index.blocks == sum(index.replica_blocks(r) for r in index.replicas())
