"""The simulated engine: step costs, batching limits, the prefix cache and its KV events."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from fleetpilot.kv_events import BlockRemoved, BlockStored, Event
from fleetpilot.routing.policies.kv_index import KVIndex, chain_keys
from fleetpilot.simulate.engine import Engine, Seq
from fleetpilot.simulate.profile import EngineCosts, EngineShape

COSTS = EngineCosts(
    prefill_base_s=0.002,
    prefill_per_token_s=0.0001,
    decode_base_s=0.01,
    decode_per_seq_s=0.001,
    decode_per_kv_token_s=0.0,
)
SHAPE = EngineShape(kv_tokens=4096, block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
# Prompts that pay for attending to their cached prefix and earlier chunks.
ATTENDING = dataclasses.replace(COSTS, prefill_per_context_token_s=2e-6, prefill_per_pair_s=4e-8)


@dataclass
class Driver:
    """Runs one engine's events in time order, as the fleet does."""

    engine: Engine
    firsts: dict[int, float] = field(default_factory=dict)
    ends: dict[int, float] = field(default_factory=dict)
    heap: list[tuple[float, int, Callable[[float], None]]] = field(default_factory=list)
    tie: itertools.count[int] = field(default_factory=itertools.count)

    def at(self, when: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self.heap, (when, next(self.tie), action))

    def submit(self, when: float, seq: Seq) -> None:
        self.at(when, lambda now: self._wake(self.engine.submit(seq, now)))

    def _wake(self, when: float | None) -> None:
        if when is None:
            return
        version = self.engine.version

        def wake(now: float) -> None:
            if self.engine.version == version:
                self._wake(self.engine.wake(now))

        self.at(when, wake)

    def run(self) -> None:
        while self.heap:
            when, _, action = heapq.heappop(self.heap)
            action(when)


def make(
    costs: EngineCosts = COSTS,
    shape: EngineShape = SHAPE,
    publish: Callable[[list[Event]], None] | None = None,
) -> Driver:
    driver: Driver

    def first(seq: Seq, when: float) -> None:
        driver.firsts[seq.request] = when

    def done(seq: Seq, when: float) -> None:
        driver.ends[seq.request] = when

    driver = Driver(Engine("e", costs, shape, first, done, publish))
    return driver


def seq(name: int, tokens: list[int], output: int, block_size: int = 16) -> Seq:
    return Seq(
        request=name,
        prompt_tokens=len(tokens),
        keys=chain_keys(tokens, block_size),
        token_ids=tokens,
        output_tokens=output,
    )


def test_one_request_costs_one_prefill_step_then_one_step_a_token() -> None:
    """Alone on an idle engine, a 100-token prompt is one step of 100 prompt tokens, and each
    further token one decode step of a batch of one."""
    d = make()
    d.submit(0.0, seq(1, list(range(100)), output=11))
    d.run()
    prefill_step = COSTS.decode_base_s + COSTS.prefill_per_token_s * 100
    assert d.firsts[1] == pytest.approx(prefill_step + COSTS.prefill_base_s)
    decode_step = COSTS.decode_base_s + COSTS.decode_per_seq_s
    assert d.ends[1] == pytest.approx(prefill_step + 10 * decode_step)


def test_an_arrival_mid_step_waits_for_the_step_under_way() -> None:
    """vLLM schedules between steps: a request arriving while the batch decodes starts its
    prefill when the step under way ends, not when it arrives."""
    d = make()
    d.submit(0.0, seq(1, list(range(100)), output=101))
    prefill_step = COSTS.decode_base_s + COSTS.prefill_per_token_s * 100
    decode_step = COSTS.decode_base_s + COSTS.decode_per_seq_s
    arrival = prefill_step + 5.4 * decode_step  # 40% into the sixth decode step
    d.submit(arrival, seq(2, list(range(1000, 1100)), output=2))
    d.run()
    step_end = prefill_step + 6 * decode_step
    batch_with_prompt = decode_step + COSTS.prefill_per_token_s * 100
    assert d.firsts[2] == pytest.approx(step_end + batch_with_prompt + COSTS.prefill_base_s)


def test_an_arrival_at_a_step_end_is_taken_at_once() -> None:
    d = make()
    d.submit(0.0, seq(1, list(range(100)), output=101))
    prefill_step = COSTS.decode_base_s + COSTS.prefill_per_token_s * 100
    decode_step = COSTS.decode_base_s + COSTS.decode_per_seq_s
    d.submit(prefill_step + 3 * decode_step, seq(2, list(range(1000, 1100)), output=2))
    d.run()
    batch_with_prompt = decode_step + COSTS.prefill_per_token_s * 100
    expected = prefill_step + 3 * decode_step + batch_with_prompt + COSTS.prefill_base_s
    assert d.firsts[2] == pytest.approx(expected)


def test_a_first_token_reaches_the_client_later_for_each_stream_served_beside_it() -> None:
    """The served path of a first token costs the base plus a share per other stream (their
    token writes share the engine's event loop); decoding itself is not delayed by it."""
    per_stream = 0.003
    costs = dataclasses.replace(COSTS, first_token_per_stream_s=per_stream)
    d = make(costs)
    d.submit(0.0, seq(1, list(range(100)), output=101))
    d.submit(0.0, seq(2, list(range(1000, 1100)), output=101))
    prefill_step = COSTS.decode_base_s + COSTS.prefill_per_token_s * 200
    d.submit(prefill_step, seq(3, list(range(2000, 2100)), output=2))
    d.run()
    # 1 and 2 finish their prompts in one step: each has the other (1 in the running batch
    # when 2 joins, 2 still prefilling when 1 joins).
    assert d.firsts[1] == pytest.approx(prefill_step + COSTS.prefill_base_s + per_stream)
    assert d.firsts[2] == pytest.approx(prefill_step + COSTS.prefill_base_s + per_stream)
    batch_with_prompt = COSTS.decode_base_s + 2 * COSTS.decode_per_seq_s
    batch_with_prompt += COSTS.prefill_per_token_s * 100
    third = prefill_step + batch_with_prompt + COSTS.prefill_base_s + 2 * per_stream
    assert d.firsts[3] == pytest.approx(third)
    # Without the term, the same decode: the stream ends when it would have.
    plain = make()
    plain.submit(0.0, seq(1, list(range(100)), output=101))
    plain.submit(0.0, seq(2, list(range(1000, 1100)), output=101))
    plain.submit(prefill_step, seq(3, list(range(2000, 2100)), output=2))
    plain.run()
    assert d.ends[1] == pytest.approx(plain.ends[1])


def test_a_decode_hop_pays_one_step_and_the_served_path() -> None:
    """A P/D decode hop (its KV pulled) answers after one step computing the prompt's last
    token over the other 99, and the served path, as calibrate's hand-offs measure it."""
    d = make(ATTENDING)
    hop = seq(1, list(range(100)), output=5)
    hop.prefill = False
    d.submit(0.0, hop)
    d.run()
    step = COSTS.decode_base_s + COSTS.prefill_per_token_s + 99 * 2e-6 + 99.5 * 4e-8
    assert d.firsts[1] == pytest.approx(step + COSTS.prefill_base_s)


def test_a_prompt_after_a_cached_prefix_pays_for_attending_to_it() -> None:
    """The second prompt shares 96 cached tokens with the first and computes 100 new ones:
    its step reads the 96 and prices 100 x (96 + 50) pairs; the same prompt on an engine
    without the prefix computes all 196, attending only to itself."""
    shared = list(range(96))  # six full blocks
    d = make(ATTENDING)
    d.submit(0.0, seq(1, [*shared, *range(1000, 1004)], output=1))
    d.run()
    start = max(d.ends.values())
    d.submit(start, seq(2, [*shared, *range(2000, 2100)], output=1))
    d.run()
    step = COSTS.decode_base_s + 100 * COSTS.prefill_per_token_s + 96 * 2e-6 + 100 * 146 * 4e-8
    assert d.firsts[2] - start == pytest.approx(step + COSTS.prefill_base_s)
    cold = make(ATTENDING)
    cold.submit(0.0, seq(2, [*shared, *range(2000, 2100)], output=1))
    cold.run()
    alone = COSTS.decode_base_s + 196 * COSTS.prefill_per_token_s + 196 * 98 * 4e-8
    assert cold.firsts[2] == pytest.approx(alone + COSTS.prefill_base_s)


def test_a_long_prompts_later_chunks_attend_to_its_earlier_ones() -> None:
    d = make(ATTENDING)
    d.submit(0.0, seq(1, list(range(1200)), output=1))
    d.run()
    expected, prior = 0.0, 0
    for n in (512, 512, 176):
        expected += (
            COSTS.decode_base_s
            + n * COSTS.prefill_per_token_s
            + prior * 2e-6
            + n * (prior + n / 2) * 4e-8
        )
        prior += n
    assert d.firsts[1] == pytest.approx(expected + COSTS.prefill_base_s)


def test_long_prompt_is_chunked_by_the_batched_token_budget() -> None:
    """A prompt over max_num_batched_tokens takes one step per chunk."""
    d = make()
    d.submit(0.0, seq(1, list(range(1200)), output=1))
    d.run()
    steps = [512, 512, 176]
    expected = sum(COSTS.decode_base_s + COSTS.prefill_per_token_s * n for n in steps)
    assert d.firsts[1] == pytest.approx(expected + COSTS.prefill_base_s)


def test_prompts_in_one_step_finish_together() -> None:
    """Two prompts the step's budget covers both finish at that step's end, as in vLLM."""
    d = make()
    d.submit(0.0, seq(1, list(range(100)), output=1))
    d.submit(0.0, seq(2, list(range(1000, 1100)), output=1))
    d.run()
    assert d.firsts[1] == pytest.approx(d.firsts[2])


def test_decoding_batch_slows_with_its_size() -> None:
    """Two sequences decoding together pay the per-sequence cost twice per step."""
    d = make(shape=EngineShape(4096, 16, 8, 4096))
    d.submit(0.0, seq(1, list(range(16)), output=101))
    d.submit(0.0, seq(2, list(range(100, 116)), output=101))
    d.run()
    prefill_step = COSTS.decode_base_s + COSTS.prefill_per_token_s * 32
    two = COSTS.decode_base_s + 2 * COSTS.decode_per_seq_s
    assert d.ends[1] == pytest.approx(prefill_step + 100 * two)


def test_batch_limit_queues_the_next_request_until_one_ends() -> None:
    d = make(shape=EngineShape(4096, 16, 2, 512))
    for i in range(3):
        d.submit(0.0, seq(i, list(range(i * 100, i * 100 + 32)), output=5))
    d.run()
    assert d.firsts[2] > min(d.ends[0], d.ends[1]) - 1e-9


def test_kv_room_is_needed_to_admit_a_prompt() -> None:
    """A prompt that does not fit beside the running ones waits for one of them to end."""
    d = make(
        shape=EngineShape(kv_tokens=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
    )
    d.submit(0.0, seq(1, list(range(200)), output=20))
    d.submit(0.0, seq(2, list(range(1000, 1100)), output=2))
    d.run()
    assert d.firsts[2] > d.ends[1] - 1e-9


def test_a_repeated_prompt_hits_the_prefix_cache_but_for_its_last_token() -> None:
    d = make()
    tokens = list(range(64))
    d.submit(0.0, first := seq(1, tokens, output=2))
    d.submit(1.0, again := seq(2, tokens, output=2))
    d.submit(2.0, longer := seq(3, tokens + list(range(500, 540)), output=2))
    d.run()
    assert first.cached_tokens == 0
    # All four blocks are cached; vLLM still computes the last token to sample from it.
    assert again.cached_tokens == 63
    assert longer.cached_tokens == 64
    assert d.firsts[2] - 1.0 < d.firsts[1]


def test_kv_events_tell_the_index_exactly_what_the_cache_holds() -> None:
    """Under evictions the router's KV index, fed only the engine's events, holds exactly the
    blocks the engine's prefix cache holds."""
    index = KVIndex()
    d = make(
        shape=EngineShape(kv_tokens=320, block_size=16, max_num_seqs=4, max_num_batched_tokens=512),
        publish=lambda events: index.apply("e", events),
    )
    for i in range(40):
        shared = list(range(48))  # three shared blocks, then a private tail
        d.submit(i * 0.5, seq(i, shared + list(range(1000 + 40 * i, 1040 + 40 * i)), output=3))
    d.run()
    cache = d.engine.cache
    assert len(cache) == d.engine.cache_blocks  # it evicted
    assert index.replica_blocks("e") == len(cache)
    assert all(index.holds("e", key) for key in cache)


def test_running_sequences_hold_a_shared_prompt_block_once() -> None:
    """Eight requests whose 1,008-token prompts share their first 1,000 tokens fit a 2,048-token
    pool together (the shared blocks once, as vLLM's block pool holds them); without the
    sharing each would need the room of a whole prompt and they would run two by two."""
    shape = EngineShape(kv_tokens=2048, block_size=16, max_num_seqs=8, max_num_batched_tokens=8192)
    shared = list(range(1000))
    d = make(shape=shape)
    # The first computes the shared prefix; the others arrive once it is cached.
    d.submit(0.0, seq(0, [*shared, *range(5000, 5008)], output=40))
    for i in range(1, 8):
        d.submit(0.05, seq(i, [*shared, *range(5000 + 8 * i, 5008 + 8 * i)], output=40))
    d.run()
    # All eight decode at once: each later one starts before the first one ends.
    assert all(d.firsts[i] < d.ends[0] for i in range(1, 8))
    unshared = make(shape=shape)
    for i in range(8):
        tokens = [*range(10_000 * (i + 1), 10_000 * (i + 1) + 1000), *range(8)]
        unshared.submit(0.0 if i == 0 else 0.05, seq(i, tokens, output=40))
    unshared.run()
    assert unshared.firsts[2] > unshared.ends[0] - 1e-9  # two at a time


def test_kv_room_is_all_given_back_when_the_engine_is_idle() -> None:
    d = make(
        shape=EngineShape(kv_tokens=1024, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    )
    for i in range(30):
        tokens = [*range(100), *range(1000 + 30 * i, 1000 + 30 * i + 7 * (i % 5))]
        d.submit(i * 0.02, seq(i, tokens, output=1 + i % 4))
    d.run()
    assert len(d.ends) == 30
    assert d.engine.block_refs == {}
    assert d.engine.kv_tokens_used == pytest.approx(0.0, abs=1e-6)


def test_a_block_a_running_sequence_holds_is_never_evicted() -> None:
    """A long decode holds its prompt's blocks while many other prompts churn the cache: they
    stay cached (no BlockRemoved for them) and a repeat of that prompt hits them."""
    removed: set[bytes] = set()

    def publish(events: list[Event]) -> None:
        for event in events:
            if isinstance(event, BlockRemoved):
                removed.update(event.block_hashes)

    shape = EngineShape(kv_tokens=640, block_size=16, max_num_seqs=4, max_num_batched_tokens=512)
    d = make(shape=shape, publish=publish)
    long_tokens = list(range(64))
    d.submit(0.0, held := seq(0, long_tokens, output=200))
    for i in range(1, 40):
        d.submit(i * 0.05, seq(i, list(range(1000 * i, 1000 * i + 64)), output=2))
    d.submit(2.05, again := seq(99, [*long_tokens, *range(9000, 9010)], output=2))
    d.run()
    assert removed  # the churn evicted
    assert d.firsts[99] < d.ends[0]  # the repeat came while the long decode still ran
    assert not removed & set(held.keys)
    assert again.cached_tokens == 64


# -- the host tier (engine.kvOffload) -----------------------------------------------------------

# A device cache of 8 blocks and a host tier of 64; a token's copy back costs a tenth of a
# prompt token's compute.
OFFLOAD_SHAPE = EngineShape(
    kv_tokens=128, block_size=16, max_num_seqs=4, max_num_batched_tokens=512, host_kv_tokens=1024
)
OFFLOAD_COSTS = dataclasses.replace(COSTS, host_load_per_token_s=0.00001)


def churn(d: Driver, start: float, count: int, base: int = 100_000) -> None:
    """Prompts of 96 fresh tokens (six blocks) a second apart: enough to evict the device."""
    for i in range(count):
        tokens = list(range(base + 96 * i, base + 96 * (i + 1)))
        d.submit(start + i, seq(base + i, tokens, output=2))


def test_blocks_the_device_evicted_come_back_from_the_host_tier_at_the_copy_cost() -> None:
    tokens = list(range(97))  # six full blocks and a last token
    d = make(costs=OFFLOAD_COSTS, shape=OFFLOAD_SHAPE)
    d.submit(0.0, seq(1, tokens, output=2))
    churn(d, 1.0, 3)
    d.submit(10.0, again := seq(2, tokens, output=2))
    d.run()
    # The device lost them; the host tier gave all six blocks back, none computed again.
    assert again.cached_tokens == 96
    assert again.host_tokens == 96
    assert d.engine.host_cached_total == 96
    copy_s = 96 * OFFLOAD_COSTS.host_load_per_token_s
    # Its first token: the copy, then one step computing the last token.
    one_token = COSTS.step_s(0, 0, 1) + COSTS.prefill_base_s
    assert d.firsts[2] - 10.0 == pytest.approx(copy_s + one_token, rel=0.05)

    without = make(costs=OFFLOAD_COSTS, shape=dataclasses.replace(OFFLOAD_SHAPE, host_kv_tokens=0))
    without.submit(0.0, seq(1, tokens, output=2))
    churn(without, 1.0, 3)
    without.submit(10.0, recomputed := seq(2, tokens, output=2))
    without.run()
    assert recomputed.cached_tokens == 0
    assert without.firsts[2] - 10.0 > d.firsts[2] - 10.0


def test_a_prompt_copying_from_the_host_does_not_hold_up_the_batch() -> None:
    """A long decode keeps its step pace while another prompt waits for a slow copy."""
    slow = dataclasses.replace(COSTS, host_load_per_token_s=0.01)  # ~1 s for 96 tokens
    d = make(costs=slow, shape=OFFLOAD_SHAPE)
    tokens = list(range(97))
    d.submit(0.0, seq(1, tokens, output=2))
    churn(d, 1.0, 3)
    d.submit(10.0, seq(3, list(range(50_000, 50_010)), output=40))
    d.submit(10.0, seq(2, tokens, output=2))
    d.run()
    assert d.engine.host_cached_total == 96
    # The decode of 40 tokens (~0.4 s) ends while the copy (~0.96 s) still runs.
    assert d.ends[3] < d.firsts[2]
    assert d.firsts[2] - 10.0 >= 96 * 0.01
    assert d.engine.idle
    assert not d.engine.loading


def test_the_host_tier_evicts_least_recently_used_and_its_events_say_so() -> None:
    """Fed only the engine's CPU-medium events, a mirror holds exactly what the host tier
    holds, after the tier evicted."""
    mirror: set[bytes] = set()
    media: set[str | None] = set()

    def publish(events: list[Event]) -> None:
        for event in events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                media.add(event.medium)
            if isinstance(event, BlockStored) and event.medium == "CPU":
                assert event.block_size == 16
                assert len(event.token_ids) == 16 * len(event.block_hashes)
                mirror.update(event.block_hashes)
            elif isinstance(event, BlockRemoved) and event.medium == "CPU":
                assert set(event.block_hashes) <= mirror
                mirror.difference_update(event.block_hashes)

    d = make(costs=OFFLOAD_COSTS, shape=OFFLOAD_SHAPE, publish=publish)
    churn(d, 0.0, 20)  # 120 blocks through a 64-block host tier
    d.run()
    assert len(d.engine.host) == d.engine.host_blocks == 64
    assert mirror == set(d.engine.host)
    assert media == {None, "CPU"}
    # The oldest prompts' blocks left the host tier; the newest stayed.
    newest = seq(0, list(range(100_000 + 96 * 19, 100_000 + 96 * 20)), output=1)
    oldest = seq(0, list(range(100_000, 100_096)), output=1)
    assert all(key in d.engine.host for key in newest.keys)
    assert not any(key in d.engine.host for key in oldest.keys)


def test_without_a_host_tier_nothing_is_written_to_host_memory() -> None:
    cpu_events: list[Event] = []

    def publish(events: list[Event]) -> None:
        cpu_events.extend(e for e in events if getattr(e, "medium", None) == "CPU")

    d = make(shape=dataclasses.replace(OFFLOAD_SHAPE, host_kv_tokens=0), publish=publish)
    churn(d, 0.0, 5)
    d.run()
    assert not d.engine.host
    assert not cpu_events
    assert d.engine.host_cached_total == 0
