"""The engine with a host tier: write-through stores, loads that really copy KV and are paced
by the link's bandwidth without holding other requests back, and vLLM's CPU-medium events."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from fleetpilot.engine.reference import EngineConfig, LlamaModel, LLMEngine, SamplingParams
from fleetpilot.engine.reference.metrics import ServerMetrics
from fleetpilot.engine.reference.offload import PAGE_BYTES, HostKVStore, OffloadConfig
from fleetpilot.engine.reference.request import RequestOutput, RequestStatus
from fleetpilot.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)

BS = 4
# The tiny model's block: 2 (K, V) x 3 layers x 2 heads x 16 dims x 4 bytes x 4 tokens.
BLOCK_BYTES = 3072
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = list(range(3, 43))  # 40 tokens: 10 full blocks
FILLER = list(range(200, 256))  # 56 tokens: takes 14 of the 16 device blocks


class Clock:
    """The engine's clock, moved by the test only."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def offload_engine(
    model: LlamaModel,
    clock: Clock,
    *,
    host_blocks: int = 64,
    bandwidth: float = 1e12,
    events: bool = True,
    **overrides: Any,
) -> LLMEngine:
    """16 device blocks of 4 tokens, a host tier of ``host_blocks``, events on."""
    offload = {
        "capacity_bytes": host_blocks * PAGE_BYTES,
        "bandwidth_bytes_per_s": bandwidth,
        **overrides.pop("offload", {}),
    }
    config = EngineConfig(
        num_kv_blocks=16,
        block_size=BS,
        max_model_len=128,
        enable_kv_cache_events=events,
        kv_offload=OffloadConfig(**offload),
        **overrides,
    )
    return LLMEngine(config, model, clock=clock)


def run(
    engine: LLMEngine,
    clock: Clock,
    prompts: dict[str, Sequence[int]],
    *,
    dt: float = 0.001,
    events: list[list[Event]] | None = None,
) -> dict[str, RequestOutput]:
    """Add ``prompts`` and step until they finish, the clock moving ``dt`` a step; every
    step's events (one list a step) go to ``events``."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    final: dict[str, RequestOutput] = {}
    for _ in range(10_000):
        if len(final) == len(prompts):
            break
        clock.now += dt
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        batch = engine.take_kv_events()
        if events is not None:
            events.append(list(batch.events) if batch is not None else [])
    else:
        raise AssertionError("the requests did not finish")
    return final


def evict_from_device(engine: LLMEngine, clock: Clock) -> None:
    """A prompt that takes the device pool, pushing the earlier prompts' blocks out of it."""
    run(engine, clock, {f"filler-{clock.now}": FILLER})


@pytest.mark.parametrize("broken_copy", [False, True])
def test_a_prompt_served_from_the_host_tier_generates_what_a_fresh_engine_computes(
    model: LlamaModel, broken_copy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second run of a prompt whose blocks left the device loads them from the host tier
    (most of its prompt is not computed again) and produces the same greedy tokens as an engine
    that computes everything; with the load's copy broken (a no-op), it does not, so this
    test sees whether the KV was really copied."""
    if broken_copy:
        monkeypatch.setattr(HostKVStore, "load", lambda *args: None)
    clock = Clock()
    fresh = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=BS, max_model_len=128), model)
    expected = fresh.generate([PROMPT], GREEDY)[0].token_ids
    engine = offload_engine(model, clock)
    first = run(engine, clock, {"first": PROMPT})["first"]
    assert first.token_ids == expected
    evict_from_device(engine, clock)
    device_hits = engine.stats().prefix_cache_hits_total
    again = run(engine, clock, {"again": PROMPT})["again"]
    stats = engine.stats()
    assert stats.external_prefix_cache_hits_total >= 8 * BS  # most of the prompt
    assert again.num_cached_tokens == (
        stats.prefix_cache_hits_total - device_hits + stats.external_prefix_cache_hits_total
    )
    assert stats.kv_offload_load_bytes_total == (
        stats.external_prefix_cache_hits_total // BS * BLOCK_BYTES
    )
    assert (again.token_ids == expected) is not broken_copy
    engine.blocks.check_invariants()
    assert engine.host is not None
    engine.host.check_invariants()


def test_a_load_holds_its_request_for_bytes_over_bandwidth_and_no_one_else(
    model: LlamaModel,
) -> None:
    """Pacing on the engine's clock: a request whose prefix is in host memory runs its first
    step only once bytes / bandwidth have passed since its admission, while a request already
    decoding gets a token every step meanwhile."""
    clock = Clock()
    bandwidth = 10 * BLOCK_BYTES  # 0.1 s a block
    engine = offload_engine(model, clock, bandwidth=bandwidth)
    run(engine, clock, {"first": PROMPT}, dt=1.0)  # stores complete a second after they start
    evict_from_device(engine, clock)
    clock.now += 10
    # 5 + 12 tokens: its blocks and the loading prompt's fit the 16 device blocks together.
    long = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request("decoding", [7] * 5, long)
    engine.step()  # its prefill
    engine.add_request("loading", PROMPT, GREEDY)
    admitted = clock.now
    engine.step()  # admission of "loading": its load starts
    request = engine._requests["loading"]
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = [t for t in engine._transfers if t.kind == "load"]
    assert load.nbytes == len(load.keys) * BLOCK_BYTES
    load_s = load.nbytes / bandwidth
    assert load.done_at == pytest.approx(admitted + load_s)
    assert load_s >= 0.5  # most of the prompt: its first block may still be on the device
    steps = 0
    while clock.now + 0.1 < admitted + load_s:
        clock.now += 0.1
        outputs = {o.request_id: o for o in engine.step()}
        steps += 1
        assert "loading" not in outputs, "it ran before its KV was in"
        assert outputs["decoding"].num_new_tokens == 1, "the load held another request back"
    assert steps >= 4
    clock.now = admitted + load_s  # the load completes at the end of this step
    engine.step()
    assert request.host_load_done
    first_token = None
    while first_token is None:
        clock.now += 0.001
        for out in engine.step():
            if out.request_id == "loading" and out.token_ids:
                first_token = out.metrics.first_token_time
    assert first_token is not None
    assert first_token - admitted >= load_s
    stats = engine.stats()
    assert stats.kv_offload_load_time_seconds_total == pytest.approx(load_s)
    assert stats.kv_offload_load_size.count == 1


def test_loads_issued_together_queue_on_the_link(model: LlamaModel) -> None:
    """Two loads in one step share one host-to-device link: the second completes after both
    have moved, not at the same time as the first."""
    clock = Clock()
    engine = offload_engine(model, clock, bandwidth=10 * BLOCK_BYTES)
    other = list(range(50, 70))  # 5 blocks
    run(engine, clock, {"a": PROMPT[:20], "b": other}, dt=1.0)
    evict_from_device(engine, clock)
    clock.now += 10
    engine.add_request("a2", PROMPT[:20], GREEDY)
    engine.add_request("b2", other, GREEDY)
    engine.step()
    issued = clock.now
    first, second = [t for t in engine._transfers if t.kind == "load"]
    assert first.done_at == pytest.approx(issued + len(first.keys) * 0.1)
    assert second.start == first.done_at
    assert second.done_at == pytest.approx(first.done_at + len(second.keys) * 0.1)


def medium(event: Event) -> str | None:
    return None if isinstance(event, AllBlocksCleared) else event.medium


def kinds(events: Sequence[Event]) -> list[tuple[str, str | None]]:
    return [(type(e).__name__, medium(e)) for e in events]


def test_the_events_of_an_offload_a_reload_and_a_host_eviction_are_vllms(
    model: LlamaModel,
) -> None:
    """Write-through: the step that computes a prompt stores it on the device (GPU), and the
    step its copies complete announces each block in host memory (CPU, vLLM's placeholder
    payload). A prompt whose blocks cannot all fit stores none (vLLM stores an offer whole). A
    reload announces the loaded blocks on the device once they are in. A store into a full host
    tier first removes the least recently used blocks (CPU, one event). In every batch the
    device's events come before the host tier's."""
    clock = Clock()
    engine = offload_engine(model, clock, host_blocks=12, bandwidth=BLOCK_BYTES / 0.5)
    batches: list[list[Event]] = []
    run(engine, clock, {"a": PROMPT}, dt=0.001, events=batches)
    flat = [e for batch in batches for e in batch]
    gpu_stored = [e for e in flat if isinstance(e, BlockStored) and e.medium == MEDIUM_GPU]
    assert gpu_stored[0].token_ids == PROMPT
    assert not [e for e in flat if medium(e) == MEDIUM_CPU]  # copies of 0.5 s a block: none done
    hashes = list(gpu_stored[0].block_hashes)
    clock.now += 10
    engine.step()
    batch = engine.take_kv_events()
    assert batch is not None
    assert batch.events == [
        BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=0,
                    lora_id=None, medium=MEDIUM_CPU, lora_name=None)
        for h in hashes
    ]  # fmt: skip

    # The filler takes every device block: "a" leaves the device; its 14 blocks cannot fit
    # beside "a"'s 10 in the host tier of 12, so they are not stored at all.
    batches.clear()
    run(engine, clock, {"filler": FILLER}, dt=10, events=batches)
    flat = [e for batch in batches for e in batch]
    removed_gpu = [h for e in flat if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(hashes) <= set(removed_gpu)
    assert all(medium(e) == MEDIUM_GPU for e in flat)
    assert engine.stats().kv_offload_allocation_failures_total > 0

    batches.clear()
    run(engine, clock, {"again": PROMPT}, dt=10, events=batches)
    flat = [e for batch in batches for e in batch]
    reloaded = [e for e in flat if isinstance(e, BlockStored)]
    assert reloaded[0] == BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=PROMPT, block_size=BS,
        lora_id=None, medium=MEDIUM_GPU, lora_name=None,
    )  # fmt: skip
    assert engine.stats().external_prefix_cache_hits_total == len(PROMPT)

    # A 4-block prompt into the tier holding 10 of 12: the two least recently used go, the
    # tail of "again" (a request's head is more recent than its tail).
    batches.clear()
    run(engine, clock, {"c": list(range(60, 76))}, dt=10, events=batches)
    flat = [e for batch in batches for e in batch]
    assert next(e for e in flat if medium(e) == MEDIUM_CPU) == BlockRemoved(
        block_hashes=[hashes[9], hashes[8]], medium=MEDIUM_CPU
    )
    for batch_events in batches:
        media = [medium(e) for e in batch_events if not isinstance(e, AllBlocksCleared)]
        assert media == sorted(media, key=lambda m: m != MEDIUM_GPU), "GPU events first"
    assert next(kinds(b) for b in batches if b)[-1] == ("BlockRemoved", MEDIUM_CPU)


def test_self_describing_events_let_a_consumer_chain_the_host_blocks(model: LlamaModel) -> None:
    """With kv_connector_extra_config.self_describing_kv_events each CPU BlockStored carries its
    block's parent hash, tokens and size: the payload of the GPU event, block by block."""
    clock = Clock()
    engine = offload_engine(model, clock, offload={"self_describing_kv_events": True})
    events: list[list[Event]] = []
    run(engine, clock, {"a": PROMPT}, events=events)
    flat = [e for batch in events for e in batch]
    gpu = next(e for e in flat if isinstance(e, BlockStored) and e.medium == MEDIUM_GPU)
    cpu = [e for e in flat if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    assert len(cpu) == 10
    for i, event in enumerate(cpu):
        assert event.block_hashes == [gpu.block_hashes[i]]
        assert event.parent_block_hash == (gpu.block_hashes[i - 1] if i else None)
        assert event.token_ids == PROMPT[i * BS : (i + 1) * BS]
        assert (event.block_size, event.lora_id, event.lora_name) == (BS, None, None)


def test_only_prompt_blocks_are_offloaded_unless_asked(model: LlamaModel) -> None:
    """vLLM's offload_prompt_only (default true): decode blocks stay on the device; with it
    false they are offered too."""
    long = SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)
    for prompt_only, host_blocks in ((True, 10), (False, 13)):
        clock = Clock()
        engine = offload_engine(model, clock, offload={"offload_prompt_only": prompt_only})
        engine.add_request("a", PROMPT, long)
        while engine.has_unfinished_requests() or engine.has_transfers_in_flight():
            clock.now += 0.01
            engine.step()
        assert engine.host is not None
        assert engine.host.num_used == host_blocks  # 40 + 13 tokens: 13 full blocks computed


def test_a_block_being_written_defers_a_request_that_would_load_it(model: LlamaModel) -> None:
    """vLLM defers a lookup that meets a pending store (HIT_PENDING): the request waits, neither
    loading nor computing, until the store completed, then loads it."""
    clock = Clock()
    engine = offload_engine(model, clock, bandwidth=BLOCK_BYTES / 1.0)  # 1 s a block
    run(engine, clock, {"a": PROMPT})  # 10 stores queued: the last completes 10 s on
    evict_from_device(engine, clock)
    engine.add_request("again", PROMPT, GREEDY)
    engine.step()
    request = engine._requests["again"]
    assert request.status is RequestStatus.WAITING
    assert request.num_computed_tokens == 0
    assert not any(t.kind == "load" for t in engine._transfers)
    clock.now += 20
    engine.step()  # the stores complete at the end of this step
    engine.step()
    assert engine._requests["again"].status is RequestStatus.WAITING_FOR_REMOTE_KVS


def test_a_second_request_for_blocks_being_loaded_waits_and_takes_them_from_the_device(
    model: LlamaModel,
) -> None:
    """vLLM defers a lookup that meets a chunk another request is loading: once that load is
    in, the blocks are device hits, so they are copied once, not twice. (Only the last block
    is loaded again, as vLLM does: a device hit leaves the last token to compute, so it stops a
    block short of a block-aligned prompt, and the host tier may supply that block.)"""
    clock = Clock()
    engine = offload_engine(model, clock, bandwidth=10 * BLOCK_BYTES)
    run(engine, clock, {"a": PROMPT}, dt=1.0)
    evict_from_device(engine, clock)
    clock.now += 10
    engine.add_request("one", PROMPT, GREEDY)
    engine.step()
    engine.add_request("two", PROMPT, GREEDY)
    engine.step()
    assert engine._requests["two"].status is RequestStatus.WAITING
    loads = [t for t in engine._transfers if t.kind == "load"]
    assert len(loads) == 1
    while engine.has_unfinished_requests():
        clock.now += 1.0
        engine.step()
    stats = engine.stats()
    assert len(loads[0].keys) == 10
    assert stats.kv_offload_load_size.count == 2
    assert stats.kv_offload_load_bytes_total == (10 + 1) * BLOCK_BYTES
    assert stats.external_prefix_cache_hits_total == (10 + 1) * BS


def test_aborting_a_request_during_its_load_frees_its_blocks_and_the_load_ends(
    model: LlamaModel,
) -> None:
    """A request aborted while its KV is on the way frees its device blocks at once; the host
    blocks it pinned are released when the copy completes."""
    clock = Clock()
    engine = offload_engine(model, clock, bandwidth=10 * BLOCK_BYTES)
    run(engine, clock, {"a": PROMPT}, dt=1.0)
    evict_from_device(engine, clock)
    engine.add_request("gone", PROMPT, GREEDY)
    engine.step()
    assert engine.abort_request("gone")
    assert engine.blocks.table("gone") == []
    assert engine.host is not None
    assert engine.host.num_pinned > 0
    clock.now += 10
    outputs = engine.step()
    assert [o.finish_reason for o in outputs] == ["abort"]
    assert engine.host.num_pinned == 0
    engine.host.check_invariants()
    engine.blocks.check_invariants()


def test_reset_external_empties_the_host_tier_silently(model: LlamaModel) -> None:
    """reset_prefix_cache leaves the host tier (vLLM's default); with reset_external it is
    emptied as vLLM's connector reset does: only the block pool's AllBlocksCleared is
    published, and the prompt is computed again."""
    clock = Clock()
    engine = offload_engine(model, clock)
    run(engine, clock, {"a": PROMPT})
    engine.take_kv_events()
    assert engine.host is not None
    engine.reset_prefix_cache()
    assert engine.host.num_used == 10
    engine.reset_prefix_cache(reset_external=True)
    assert engine.host.num_used == 0
    batch = engine.take_kv_events()
    assert batch is not None
    assert batch.events == [AllBlocksCleared(), AllBlocksCleared()]
    run(engine, clock, {"again": PROMPT})
    assert engine.stats().external_prefix_cache_hits_total == 0
    assert engine.host.num_used == 10


def test_the_host_tier_metrics_are_vllms_series_with_the_tiers_figures(
    model: LlamaModel,
) -> None:
    """/metrics: external queries are the tokens past the device hit and its hits the host's;
    prompt_tokens_cached_by_source splits the hits into device and host; the connector's load
    and store bytes, sizes and the tier's size are exported; without a host tier, no
    vllm:kv_offload_* series at all."""
    from prometheus_client.parser import text_string_to_metric_families

    clock = Clock()
    engine = offload_engine(model, clock)
    run(engine, clock, {"a": PROMPT})
    evict_from_device(engine, clock)
    run(engine, clock, {"again": PROMPT})
    s = engine.stats()
    metrics = ServerMetrics("m", max_model_len=128)
    metrics.set_stats(s)
    samples = {
        (sample.name, sample.labels.get("source", sample.labels.get("le", ""))): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }
    hits = s.external_prefix_cache_hits_total
    assert hits > 0
    assert samples[("vllm:external_prefix_cache_hits_total", "")] == hits
    # "a", the filler, then "again" (no device hit: the filler took every device block).
    expected_queries = len(PROMPT) + len(FILLER) + len(PROMPT)
    assert samples[("vllm:external_prefix_cache_queries_total", "")] == expected_queries
    assert samples[("vllm:prompt_tokens_cached_by_source_total", "host")] == hits
    assert samples[("vllm:prompt_tokens_cached_by_source_total", "device")] == (
        s.prefix_cache_hits_total
    )
    assert samples[("vllm:prompt_tokens_cached_by_source_total", "disk")] == 0
    assert samples[("vllm:kv_offload_load_bytes_total", "")] == hits // BS * BLOCK_BYTES
    # "a" and the filler: all their prompt blocks (the tier holds 64).
    assert samples[("vllm:kv_offload_store_bytes_total", "")] == (10 + 14) * BLOCK_BYTES
    assert samples[("vllm:kv_offload_load_size_count", "")] == 1
    assert samples[("vllm:kv_offload_load_size_bucket", "1e+06")] == 1
    assert samples[("vllm:kv_offload_cpu_cache_usage_perc", "")] == 0
    info = next(
        f for f in text_string_to_metric_families(metrics.render().decode())
        if f.name == "vllm:kv_offload_config_info"
    )  # fmt: skip
    assert info.samples[0].labels["cpu_num_chunks"] == "64"
    assert info.samples[0].labels["cpu_kv_cache_size_bytes"] == str(64 * PAGE_BYTES)
    plain = ServerMetrics("m", max_model_len=128)
    plain.set_stats(LLMEngine(EngineConfig(num_kv_blocks=16, max_model_len=128), model).stats())
    text = plain.render().decode()
    assert "vllm:kv_offload" not in text
    assert "vllm:external_prefix_cache_hits_total" in text


def test_a_loaded_request_behind_one_it_blocks_still_runs(model: LlamaModel) -> None:
    """Regression: a request whose lookup was deferred (its blocks still being written) let one
    behind it start a load, which holds 10 of the 16 device blocks; once the first could load
    too, it did not fit beside that hold, and strict first-come-first-served kept the loaded
    request behind it waiting: nothing ran, for ever. A loaded request holds its blocks already,
    so it starts, finishes and frees them, and the first one follows."""
    clock = Clock()
    engine = offload_engine(model, clock, bandwidth=BLOCK_BYTES / 1.0)  # a block a second
    other = list(range(100, 140))  # 10 blocks, like PROMPT
    run(engine, clock, {"other": other}, dt=1.0)
    while engine.has_transfers_in_flight():  # stored and ready
        clock.now += 1
        engine.step()
    run(engine, clock, {"a": PROMPT}, dt=0.001)  # its stores still in flight...
    evict_from_device(engine, clock)  # ... and it is off the device (so is "other")
    engine.add_request("first", PROMPT, GREEDY)
    engine.add_request("behind", other, GREEDY)
    engine.step()
    assert engine._requests["first"].status is RequestStatus.WAITING  # deferred
    assert engine._requests["behind"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    finished = set()
    for _ in range(200):
        clock.now += 100
        finished |= {o.request_id for o in engine.step() if o.finished}
        if finished == {"first", "behind"}:
            break
    assert finished == {"first", "behind"}
    assert engine.stats().external_prefix_cache_hits_total == 2 * len(PROMPT)
