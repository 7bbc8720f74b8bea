"""The engine end to end: batching, caching, chunking, preemption, P/D hand-off, metrics."""

from __future__ import annotations

import random

import pytest
import torch

from fleetpilot.engine.reference import (
    EngineConfig,
    LLMEngine,
    RequestOutput,
    RequestRejectedError,
    SamplingParams,
)
from tests.engine.reference.conftest import EngineFactory

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SYSTEM = "You are a helpful assistant. Answer briefly and precisely. "
PROMPTS = [SYSTEM + q for q in ("What is KV cache?", "Why page it?", "And prefix caching?")] + [
    "An unrelated prompt that shares nothing with the others at all",
    "x",
]


def tokens(outputs: list[RequestOutput]) -> list[tuple[int, ...]]:
    return [o.token_ids for o in outputs]


def one_at_a_time(
    make_engine: EngineFactory, prompts: list[str], params: SamplingParams
) -> list[tuple[int, ...]]:
    return [make_engine().generate([p], params)[0].token_ids for p in prompts]


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError(f"requests still unfinished after {max_steps} steps (deadlock?)")


def test_continuous_batching_matches_one_at_a_time(make_engine: EngineFactory) -> None:
    """Requests arriving at different steps and batched together get the same greedy tokens as
    each run alone."""
    engine = make_engine(max_num_seqs=3)
    final: dict[str, RequestOutput] = {}
    pending = list(enumerate(PROMPTS))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, GREEDY)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    got = [final[f"r{i}"].token_ids for i in range(len(PROMPTS))]
    assert got == one_at_a_time(make_engine, PROMPTS, GREEDY)


def test_prefix_caching_on_equals_off_and_hits_the_shared_prefix(
    make_engine: EngineFactory,
) -> None:
    """Prefix caching changes what is computed, not what is generated; the shared system
    prompt's full blocks are hits for every request after the first."""
    off_engine = make_engine(enable_prefix_caching=False)
    off = [off_engine.generate([p], GREEDY)[0] for p in PROMPTS]
    on_engine = make_engine()
    on = [on_engine.generate([p], GREEDY)[0] for p in PROMPTS]
    assert tokens(on) == tokens(off)
    shared_blocks = len(on_engine.tokenizer.encode(SYSTEM)) // 16
    assert [o.num_cached_tokens for o in on[:3]] == [0] + [16 * shared_blocks] * 2
    stats = on_engine.stats()
    assert stats.prefix_cache_hits_total == 2 * 16 * shared_blocks
    assert stats.prefix_cache_queries_total == sum(len(o.prompt_token_ids) for o in on)
    assert off_engine.stats().prefix_cache_hits_total == 0


def test_whole_prompt_cached_recomputes_only_the_last_block(make_engine: EngineFactory) -> None:
    """The same prompt twice: the second run reuses every full block but the one holding the
    last token, and generates the same tokens."""
    engine = make_engine()
    prompt = list(range(1, 49))  # exactly 3 blocks
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == 32
    assert second.token_ids == first.token_ids


def test_chunked_prefill_equals_unchunked(make_engine: EngineFactory) -> None:
    """A small token budget splits prompts into chunks mixed with decodes; tokens are the same
    as prefilling each prompt in one pass."""
    unchunked = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=256)
    chunked = make_engine(max_num_batched_tokens=7)
    assert tokens(chunked.generate(PROMPTS, GREEDY)) == tokens(unchunked.generate(PROMPTS, GREEDY))
    assert chunked.stats().steps_total > unchunked.stats().steps_total


def test_memory_pressure_completes_everything_with_preemptions(make_engine: EngineFactory) -> None:
    """Twenty requests on a pool that holds about two of them: all finish (no deadlock), with
    preemptions counted, the greedy tokens of running alone, and every block returned."""
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(4, 24))] for _ in range(20)]
    params = [
        SamplingParams(max_tokens=rng.randrange(8, 24), temperature=0, ignore_eos=True)
        for _ in prompts
    ]
    engine = make_engine(num_kv_blocks=14, block_size=4, max_model_len=48, max_num_seqs=16)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    final = run_all(engine)
    stats = engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.request_success_total == {"length": 20}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        assert final[f"r{i}"].token_ids == make_engine().generate([p], sp)[0].token_ids
    assert any(final[f"r{i}"].metrics.num_preemptions for i in range(20))
    assert engine.blocks.num_free_blocks == 14
    assert stats.kv_cache_usage_perc == 0.0
    engine.blocks.check_invariants()


def test_memory_pressure_with_speculation_and_int8_kv(make_engine: EngineFactory) -> None:
    """The same pressure with speculative lookahead and an int8 pool also drains completely."""
    from fleetpilot.engine.reference import SpeculativeConfig

    rng = random.Random(1)
    engine = make_engine(
        num_kv_blocks=10,
        block_size=4,
        max_model_len=40,
        kv_cache_dtype="int8",
        speculative=SpeculativeConfig(num_speculative_tokens=3),
    )
    for i in range(12):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(4, 20))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    final = run_all(engine)
    assert all(len(o.token_ids) == 16 for o in final.values())
    assert len(final) == 12
    assert engine.stats().num_preemptions_total > 0
    assert engine.blocks.num_free_blocks == 10


def test_requests_that_can_never_fit_are_refused_up_front(make_engine: EngineFactory) -> None:
    """Too long for the model, too large for the whole pool, or malformed: a clear error at
    add_request instead of a request that would wait forever."""
    engine = make_engine(num_kv_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejectedError, match="whole KV pool holds 4 blocks"):
        engine.add_request("big", [1] * 10, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejectedError, match="maximum context length"):
        engine.add_request("long", [1] * 64, SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejectedError, match="plus max_tokens"):
        engine.add_request("long", [1] * 10, SamplingParams(max_tokens=60))
    with pytest.raises(RequestRejectedError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(RequestRejectedError, match=r"\[0, 258\)"):
        engine.add_request("oov", [300], SamplingParams())
    engine.add_request("ok", [1] * 8, SamplingParams(max_tokens=8))
    with pytest.raises(RequestRejectedError, match="already in use"):
        engine.add_request("ok", [1], SamplingParams())
    assert not engine.scheduler.running
    assert len(engine.scheduler.waiting) == 1


def test_abort_frees_blocks_and_reports_once(make_engine: EngineFactory) -> None:
    """An aborted running request gives back its blocks and yields one final output."""
    engine = make_engine()
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.blocks.num_free_blocks < 256
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    (out,) = engine.step()
    assert out.finished
    assert out.finish_reason == "abort"
    assert engine.blocks.num_free_blocks == 256
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_metrics_timestamps_and_counters(make_engine: EngineFactory) -> None:
    """TTFT, per-token times and token counters come from the engine clock and the steps."""
    now = [100.0]

    def clock() -> float:
        now[0] += 0.5
        return now[0]

    engine = LLMEngine(
        EngineConfig(num_kv_blocks=64, max_model_len=128), make_engine().model, clock=clock
    )
    engine.add_request("a", "hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    m = outs[-1].metrics
    assert [o.num_new_tokens for o in outs] == [1, 1, 1]
    assert m.arrival_time == 100.5
    assert m.first_scheduled_time == 101.0
    assert m.ttft_s == 1.0  # scheduled at 101.0, forward done at 101.5
    assert m.token_times == (101.5, 102.5, 103.5)
    assert m.inter_token_latencies_s == [1.0, 1.0]
    stats = engine.stats()
    assert stats.prompt_tokens_total == 6
    assert stats.generation_tokens_total == 3
    assert stats.request_success_total == {"length": 1}
    assert stats.num_requests_running == 0
    assert stats.num_requests_waiting == 0


def test_running_and_waiting_gauges_and_kv_usage(make_engine: EngineFactory) -> None:
    """Gauges reflect the scheduler: max_num_seqs running, the rest waiting, blocks in use."""
    engine = make_engine(max_num_seqs=2)
    for i in range(3):
        engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (2, 1)
    assert stats.kv_cache_usage_perc == pytest.approx(engine.blocks.usage)
    assert 0 < stats.kv_cache_usage_perc < 1


def test_pd_handoff_export_import_skips_prefill(make_engine: EngineFactory) -> None:
    """A prefill engine pins the prompt's KV after a max_tokens=1 request; a decode engine that
    imports it computes only the last prompt token and generates what one engine would."""
    prompt = PROMPTS[0]
    reference = make_engine().generate([prompt], GREEDY)[0]

    prefill = make_engine()
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0), pin_kv=True)
    first = run_all(prefill)["p"]
    assert first.token_ids == reference.token_ids[:1]
    pin = prefill.pinned_kv("p")
    assert pin is not None
    assert len(pin.token_ids) == len(first.prompt_token_ids)
    free_while_pinned = prefill.blocks.num_free_blocks
    kv = prefill.export_kv("p")
    assert kv.block_ids == pin.block_ids

    decode = make_engine()
    decode.add_request("d", prompt, GREEDY, kv_import=kv)
    out = run_all(decode)["d"]
    assert out.token_ids == reference.token_ids
    n = len(out.prompt_token_ids)
    assert out.num_cached_tokens == n - 1
    assert decode.stats().kv_imported_tokens_total == n - 1

    assert prefill.release_kv("p")
    assert prefill.pinned_kv("p") is None
    assert prefill.blocks.num_free_blocks == free_while_pinned + len(pin.block_ids)


def test_pd_import_really_uses_the_transferred_blocks(make_engine: EngineFactory) -> None:
    """Corrupted imported KV changes the output: the decoder did not silently recompute."""
    prompt = PROMPTS[1]
    prefill = make_engine()
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1), pin_kv=True)
    run_all(prefill)
    kv = prefill.export_kv("p")
    reference = make_engine().generate([prompt], GREEDY)[0]
    garbage = type(kv)(kv.token_ids, kv.block_size, kv.block_ids, torch.randn_like(kv.data) * 3)
    decode = make_engine()
    decode.add_request("d", prompt, GREEDY, kv_import=garbage)
    assert run_all(decode)["d"].token_ids != reference.token_ids


def test_pd_unusable_import_falls_back_to_prefill_and_counts(make_engine: EngineFactory) -> None:
    """KV for another prompt, or another pool layout, is ignored: local prefill, counted."""
    prefill = make_engine()
    prefill.add_request("p", PROMPTS[0], SamplingParams(max_tokens=1), pin_kv=True)
    run_all(prefill)
    kv = prefill.export_kv("p")
    decode = make_engine(block_size=8)
    decode.add_request("wrong-layout", PROMPTS[0], GREEDY, kv_import=kv)
    other = make_engine()
    other.add_request("wrong-prompt", PROMPTS[1], GREEDY, kv_import=kv)
    assert (
        run_all(other)["wrong-prompt"].token_ids
        == make_engine().generate([PROMPTS[1]], GREEDY)[0].token_ids
    )
    assert decode.stats().kv_import_fallbacks_total == 1
    assert other.stats().kv_import_fallbacks_total == 1
    assert other.stats().kv_imported_tokens_total == 0


def test_pinned_kv_expires_and_is_dropped_when_the_pool_is_starved(
    make_engine: EngineFactory,
) -> None:
    """Pins are freed at their TTL, and early (counted) when a queued request needs the pool."""
    now = [0.0]
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=8, block_size=4, max_model_len=32, kv_pin_ttl_s=10.0),
        make_engine().model,
        clock=lambda: now[0],
    )
    engine.add_request("p", [5] * 12, SamplingParams(max_tokens=1), pin_kv=True)
    run_all(engine)
    assert engine.pinned_kv("p") is not None
    assert engine.blocks.num_free_blocks == 5
    now[0] = 10.0
    engine.step()
    assert engine.pinned_kv("p") is None
    assert engine.blocks.num_free_blocks == 8
    with pytest.raises(KeyError):
        engine.export_kv("p")

    engine.add_request("q", [6] * 12, SamplingParams(max_tokens=1), pin_kv=True)
    run_all(engine)
    engine.add_request("big", [7] * 24, SamplingParams(max_tokens=8, ignore_eos=True))
    final = run_all(engine)
    assert len(final["big"].token_ids) == 8
    assert engine.pinned_kv("q") is None
    assert engine.stats().kv_pins_evicted_total == 1


def test_only_computed_blocks_are_shared_with_a_concurrent_identical_prompt(
    make_engine: EngineFactory,
) -> None:
    """A request arriving while an identical prompt is still being prefilled in chunks reuses
    only the blocks already computed, never blocks whose KV is not written yet."""
    prompt = list(range(1, 65))  # 4 blocks
    engine = make_engine(max_num_batched_tokens=40)
    engine.add_request("a", prompt, GREEDY)
    engine.step()  # a: tokens 0-39 computed, blocks 0-1 full, block 2 half written
    engine.add_request("b", prompt, GREEDY)
    final = run_all(engine)
    assert final["b"].num_cached_tokens == 32
    assert final["b"].token_ids == final["a"].token_ids
