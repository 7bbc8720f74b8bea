"""Continuous batching with chunked prefill and preemption by recompute. Purely computational.

Every step the scheduler fills a token budget (``max_num_batched_tokens``) the way vLLM's does:

1. Running requests first, oldest first. A decode takes 1 token; a request still prefilling
   takes as much of its remaining prompt as the budget allows (chunked prefill), so long
   prompts share steps with decodes instead of stalling them.
2. When the pool has no block for a running request, the *newest* running request is preempted:
   its blocks are freed and it goes back to the front of the queue to be recomputed later (its
   freed full blocks stay in the prefix cache, so recompute is often mostly cache hits). Taking
   the newest keeps FCFS: the oldest request always progresses, so the engine cannot deadlock
   as long as every request alone fits in the pool, which admission checks up front.
3. If nothing was preempted: speculative lookahead for decodes, from spare blocks and budget
   only, so speculation never preempts anyone.
4. Then, again only if nothing was preempted, waiting requests in arrival order while
   ``max_num_seqs`` and the budget allow; a request that does not fit stops admission (strict
   FCFS, no overtaking by smaller requests). With LoRA, the running requests never use more
   than ``max_loras`` distinct adapters (vLLM's rule): a waiting request whose adapter would
   exceed that is skipped, keeping its place, and requests behind it may be admitted.

The scheduler owns no tensors: it changes ``BlockManager`` bookkeeping and returns what the
engine must run (``SchedulerOutput``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fleetpilot.engine.reference.blocks import BlockManager, extend_block_hashes
from fleetpilot.engine.reference.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0
    max_loras: int | None = None  # distinct adapters among running requests; None: no LoRA

    def __post_init__(self) -> None:
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1 + self.num_speculative_tokens:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must leave room for a "
                f"decode with {self.num_speculative_tokens} speculative tokens"
            )


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # committed tokens fed this step (prompt chunk, or the last token)
    num_spec_tokens: int  # speculative tokens to draft and verify on top


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # Requests admitted with imported KV: the engine writes the data into these blocks.
    imports: list[tuple[Request, list[int]]] = field(default_factory=list)
    # Nothing runs and the head of the queue does not fit: only pinned blocks can be holding
    # the pool, and the engine should release one.
    starved: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_spec_tokens for s in self.scheduled)


class Scheduler:
    """Waiting queue, running list and the per-step plan."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free_seq(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.blocks.free_seq(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _spec_tokens(self, request: Request, budget: int) -> int:
        """Lookahead for a request in decode, within ``budget - 1`` tokens and its max_tokens."""
        k = self.config.num_speculative_tokens
        if k == 0 or request.num_computed_tokens != request.num_tokens - 1:
            return 0
        remaining = request.max_tokens - request.num_output_tokens
        return max(0, min(k, remaining - 1, budget - 1))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            copies = None
            while True:
                copies = self.blocks.allocate(
                    request.request_id,
                    request.num_computed_tokens + num_new,
                    write_from=request.num_computed_tokens,
                )
                if copies is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if copies is None:
                break  # the request preempted itself: nobody after it is left running
            out.block_copies += copies
            out.scheduled.append(ScheduledRequest(request, num_new, 0))
            budget -= num_new
            i += 1
        if out.preempted:
            return out
        budget = self._add_speculation(out, budget)
        loras = self.running_loras()
        skipped: list[Request] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            request = self.waiting[0]
            lora = request.lora.lora_int_id if request.lora is not None else None
            if lora is not None and lora not in loras and len(loras) == self.config.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if not self._admit(request, budget, out):
                out.starved = not self.running
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if lora is not None:
                loras.add(lora)
            scheduled = out.scheduled[-1]
            budget -= scheduled.num_new_tokens
        self.waiting.extendleft(reversed(skipped))
        return out

    def running_loras(self) -> set[int]:
        """The adapters (``lora_int_id``) of the running requests."""
        return {r.lora.lora_int_id for r in self.running if r.lora is not None}

    def _add_speculation(self, out: SchedulerOutput, budget: int) -> int:
        """Give decodes their speculative lookahead from what the committed tokens left over.

        A second pass, so speculation only ever uses spare blocks and budget: it never causes a
        preemption, and never outranks another request's committed token.
        """
        if self.config.num_speculative_tokens == 0:
            return budget
        for j, s in enumerate(out.scheduled):
            spec = self._spec_tokens(s.request, budget + 1)
            if spec == 0:
                continue
            r = s.request
            copies = self.blocks.allocate(
                r.request_id,
                r.num_computed_tokens + s.num_new_tokens + spec,
                write_from=r.num_computed_tokens,
            )
            if copies is None:
                continue
            out.block_copies += copies
            out.scheduled[j] = ScheduledRequest(r, s.num_new_tokens, spec)
            budget -= spec
        return budget

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> bool:
        bs = self.blocks.block_size
        hits: list[int] = []
        # At least the last token is computed here: its logits give the next token.
        max_reuse = request.num_tokens - 1
        imported = request.kv_import
        if imported is not None:
            computed = min(imported.num_tokens, max_reuse)
        else:
            if self.blocks.enable_prefix_caching:
                extend_block_hashes(request.block_hashes, request.token_ids, bs, request.hash_extra)
            hits = self.blocks.match_prefix(request.block_hashes, max_reuse)
            computed = len(hits) * bs
        num_new = request.num_tokens - computed
        if num_new > budget and not self.config.enable_chunked_prefill:
            return False
        num_new = min(num_new, budget)
        copies = self.blocks.allocate(
            request.request_id, computed + num_new, write_from=computed, hit_blocks=hits
        )
        if copies is None:
            return False
        if imported is None:
            self.blocks.record_query(request.num_tokens, computed)
        else:
            table = self.blocks.table(request.request_id)
            out.imports.append((request, table[: -(-computed // bs)]))
        request.num_computed_tokens = computed
        if request.num_cached_tokens is None:
            request.num_cached_tokens = computed
        out.block_copies += copies
        out.scheduled.append(ScheduledRequest(request, num_new, 0))
        return True
