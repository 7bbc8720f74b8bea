"""Scheduling decisions on plain requests and a block manager, without a model."""

from __future__ import annotations

from fleetpilot.engine.reference import SamplingParams
from fleetpilot.engine.reference.blocks import BlockManager
from fleetpilot.engine.reference.request import Request
from fleetpilot.engine.reference.scheduler import Scheduler, SchedulerConfig

BS = 4


def make_request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(100, 100 + prompt_len)),
        params=SamplingParams(max_tokens=max_tokens),
        arrival_time=0.0,
        max_tokens=max_tokens,
        eos_token_id=None,
    )


def advance(sched: Scheduler) -> dict[str, int]:
    """One step as the engine would run it: commit computed tokens, append one sampled token."""
    plan = sched.schedule()
    for s in plan.scheduled:
        r = s.request
        r.num_computed_tokens += s.num_new_tokens
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(7)
    return {s.request.request_id: s.num_new_tokens for s in plan.scheduled}


def test_budget_chunks_a_long_prompt_and_mixes_it_with_decodes() -> None:
    """Decodes go first; a long prompt is prefilled in budget-sized chunks alongside them."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10), BlockManager(64, BS))
    sched.add(make_request("short", 3))
    assert advance(sched) == {"short": 3}
    sched.add(make_request("long", 25))
    assert advance(sched) == {"short": 1, "long": 9}
    assert advance(sched) == {"short": 1, "long": 9}
    assert advance(sched) == {"short": 1, "long": 7}
    assert advance(sched) == {"short": 1, "long": 1}


def test_without_chunking_a_prompt_waits_for_a_step_it_fits_whole() -> None:
    """With chunked prefill off a prompt is never split; it waits until the budget holds it."""
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=10, enable_chunked_prefill=False),
        BlockManager(64, BS),
    )
    sched.add(make_request("a", 4))
    sched.add(make_request("b", 10))
    assert advance(sched) == {"a": 4}
    assert advance(sched) == {"a": 1}  # b needs 10 but only 9 are left after a's decode


def test_max_num_seqs_caps_the_running_batch() -> None:
    """No more than max_num_seqs requests run at once; the rest wait in order."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), BlockManager(64, BS))
    for i in range(4):
        sched.add(make_request(f"r{i}", 2))
    assert set(advance(sched)) == {"r0", "r1"}
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first() -> None:
    """When the oldest request needs a block, the newest running one is preempted (FCFS), its
    blocks are freed and it goes to the head of the queue, ahead of later arrivals."""
    bm = BlockManager(4, BS)
    sched = Scheduler(SchedulerConfig(), bm)
    sched.add(make_request("old", 8))  # 2 blocks
    sched.add(make_request("new", 7))  # 2 blocks: the pool is full
    advance(sched)
    sched.add(make_request("later", 2))
    plan = sched.schedule()  # "old" now needs a third block
    assert [r.request_id for r in plan.preempted] == ["new"]
    assert [s.request.request_id for s in plan.scheduled] == ["old"]
    assert [r.request_id for r in sched.waiting] == ["new", "later"]
    assert sched.waiting[0].num_computed_tokens == 0
    assert sched.num_preemptions == 1
    bm.check_invariants()


def test_a_request_that_cannot_grow_preempts_itself_and_starves_nobody() -> None:
    """The only running request short of blocks (pool held elsewhere) is requeued, and the plan
    says the queue is starved so the engine can release pinned blocks."""
    bm = BlockManager(2, BS)
    bm.allocate("pinned", 4, write_from=0)  # something outside the scheduler holds a block
    sched = Scheduler(SchedulerConfig(), bm)
    sched.add(make_request("r", 4))
    advance(sched)
    plan = sched.schedule()
    assert [r.request_id for r in plan.preempted] == ["r"]
    assert not plan.scheduled
    plan = sched.schedule()
    assert plan.starved
    assert not plan.scheduled


def test_speculative_lookahead_only_uses_spare_blocks() -> None:
    """The older request's lookahead must not take the block a newer request needs for its
    committed token: speculation is dropped instead of preempting anyone."""
    bm = BlockManager(4, BS)
    sched = Scheduler(SchedulerConfig(num_speculative_tokens=3), bm)
    sched.add(make_request("a", 7, max_tokens=20))  # 8 tokens after prefill: 2 full blocks
    sched.add(make_request("b", 4, max_tokens=20))  # 5 tokens: its decode needs a 2nd block
    advance(sched)
    plan = sched.schedule()
    spec = {s.request.request_id: s.num_spec_tokens for s in plan.scheduled}
    assert not plan.preempted
    # a's lookahead would need a new block; b's fits in the free slots of its own last block.
    assert spec == {"a": 0, "b": 3}
    assert len(bm.table("a")) == 2
    assert len(bm.table("b")) == 2


def test_speculative_lookahead_respects_budget_and_max_tokens() -> None:
    """Lookahead is capped so verification never runs past max_tokens or the token budget."""
    sched = Scheduler(
        SchedulerConfig(num_speculative_tokens=4, max_num_batched_tokens=6), BlockManager(64, BS)
    )
    sched.add(make_request("a", 3, max_tokens=3))
    sched.add(make_request("b", 3, max_tokens=20))
    advance(sched)
    plan = sched.schedule()
    spec = {s.request.request_id: s.num_spec_tokens for s in plan.scheduled}
    # a has 2 tokens left: one verified draft + the bonus. b gets what the budget leaves.
    assert spec == {"a": 1, "b": 3}
    assert plan.num_tokens == 6
