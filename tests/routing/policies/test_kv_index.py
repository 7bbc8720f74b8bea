"""The KV-event index: block content -> replicas, built from BlockStored/BlockRemoved/
AllBlocksCleared, matched by a request's token ids, bounded by an LRU."""

from __future__ import annotations

import random
from hashlib import blake2b

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetpilot.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from fleetpilot.routing.policies.kv_index import ROOT, KVIndex, chain_keys

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


def test_inconsistent_and_offloaded_events_are_not_indexed() -> None:
    """A BlockStored whose token count does not fill its blocks, or with a token id beyond 32
    bits, is counted invalid; CPU-offload events are ignored (not in GPU cache)."""
    index = KVIndex()
    applied = index.apply(
        "a",
        [
            stored([1, 2], PROMPT[:7]),
            stored([1], [2**40, 0, 0, 0]),
            stored([1], PROMPT[:4], block_size=0),
            stored([1], PROMPT[:4], medium="CPU"),
        ],
    )
    assert (applied.events, applied.invalid_events) == (4, 3)
    assert index.stats.other_medium_events == 1
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
