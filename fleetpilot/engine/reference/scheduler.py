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
5. With a host tier (offload.py), admission looks past the device prefix hit for a run of
   host-resident blocks. A request that has one gets blocks for its whole prompt, the load is
   planned (``SchedulerOutput.host_loads``) and the request waits for it
   (``WAITING_FOR_REMOTE_KVS``) keeping its place, like a skipped LoRA request, without taking
   budget; once the engine marks the load done it is admitted with those tokens computed (the
   loaded blocks enter the prefix cache then, as vLLM caches them when the load completes). A
   lookup the tier defers (a block still being written) skips the request for this step. When
   a request does not fit, loaded requests behind it may still start (they hold their blocks
   already), or a loaded request behind a request it blocks would never run.

The scheduler owns no tensors: it changes ``BlockManager`` bookkeeping and returns what the
engine must run (``SchedulerOutput``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from fleetpilot.engine.reference.blocks import BlockManager, extend_block_hashes
from fleetpilot.engine.reference.offload import HostTier
from fleetpilot.engine.reference.request import Request, RequestStatus

# What admission did with the request at the head of the queue.
Admission = Literal["scheduled", "loading", "deferred", "refused"]


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


@dataclass(frozen=True)
class HostLoad:
    """A load from the host tier to perform: copy host ``slots`` into ``device_blocks``."""

    request: Request
    keys: tuple[bytes, ...]
    device_blocks: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass
class ExternalCacheStats:
    """The host tier's prefix-cache counters in tokens (vLLM's connector prefix cache stats):
    queries are the prompt tokens past the device hit, hits those the tier supplied. As vLLM's,
    they count a request's first admission only, not its admissions after a preemption."""

    queries: int = 0
    hits: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # Requests admitted with imported KV: the engine writes the data into these blocks.
    imports: list[tuple[Request, list[int]]] = field(default_factory=list)
    # Requests admitted with host-tier hits: the engine copies these in and paces them.
    host_loads: list[HostLoad] = field(default_factory=list)
    # Nothing runs and the head of the queue does not fit: only pinned blocks can be holding
    # the pool, and the engine should release one.
    starved: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_spec_tokens for s in self.scheduled)


class Scheduler:
    """Waiting queue, running list and the per-step plan."""

    def __init__(
        self, config: SchedulerConfig, blocks: BlockManager, host: HostTier | None = None
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.host = host
        self.external_stats = ExternalCacheStats()
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
        request.next_stored_block = 0
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
        blocked = False  # a request did not fit: only loaded ones (holding their blocks) follow
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            request = self.waiting[0]
            loading = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
            if blocked and not (loading and request.host_load_done):
                skipped.append(self.waiting.popleft())
                continue
            lora = request.lora.lora_int_id if request.lora is not None else None
            if lora is not None and lora not in loras and len(loras) == self.config.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if loading and not request.host_load_done:
                skipped.append(self.waiting.popleft())
                continue
            admission = self._admit(request, budget, out)
            if admission in ("loading", "deferred"):
                skipped.append(self.waiting.popleft())
                continue
            if admission == "refused":
                out.starved |= not blocked and not self.running
                if self.host is None or blocked:
                    break
                # A request that waited for its load behind this one already holds its prompt's
                # blocks: starting it takes none from this one, and holding it back could leave
                # this one waiting for blocks that only its finishing would free.
                blocked = True
                skipped.append(self.waiting.popleft())
                continue
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

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> Admission:
        bs = self.blocks.block_size
        hits: list[int] = []
        # At least the last token is computed here: its logits give the next token.
        max_reuse = request.num_tokens - 1
        imported = request.kv_import
        loaded = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        if loaded:
            computed = self._loaded_tokens(request)
        elif imported is not None:
            computed = min(imported.num_tokens, max_reuse)
        else:
            if self.blocks.enable_prefix_caching:
                extend_block_hashes(request.block_hashes, request.token_ids, bs, request.hash_extra)
            hits = self.blocks.match_prefix(request.block_hashes, max_reuse)
            computed = len(hits) * bs
            if self.host is not None:
                host = self._admit_from_host(request, hits, out)
                if host != "scheduled":
                    return host
        num_new = request.num_tokens - computed
        if num_new > budget and not self.config.enable_chunked_prefill:
            return "refused"
        num_new = min(num_new, budget)
        copies = self.blocks.allocate(
            request.request_id, computed + num_new, write_from=computed, hit_blocks=hits
        )
        if copies is None:
            return "refused"
        if imported is not None:
            table = self.blocks.table(request.request_id)
            out.imports.append((request, table[: -(-computed // bs)]))
        elif not loaded:
            self.blocks.record_query(request.num_tokens, computed)
            request.next_stored_block = 0
        request.num_computed_tokens = computed
        if request.num_cached_tokens is None:
            request.num_cached_tokens = computed
        out.block_copies += copies
        out.scheduled.append(ScheduledRequest(request, num_new, 0))
        return "scheduled"

    def _admit_from_host(
        self, request: Request, hits: list[int], out: SchedulerOutput
    ) -> Admission:
        """Plan a load of the host blocks that follow the device hit ``hits`` (vLLM's
        ``get_num_new_matched_tokens`` then ``update_state_after_alloc``); "scheduled" when
        there is none, so the request is admitted as usual."""
        assert self.host is not None
        bs = self.blocks.block_size
        first = len(hits)
        # vLLM's connector may match the whole prompt; the last token is computed again after
        # the load (see _loaded_tokens).
        keys = request.block_hashes[first : request.num_tokens // bs]
        found = self.host.lookup(keys)
        if found is None:
            return "deferred"
        first_admission = request.num_preemptions == 0
        if found == 0:
            if first_admission:
                self.external_stats.queries += request.num_tokens - first * bs
            return "scheduled"
        # The whole prompt's blocks now: a waiting load is not preemptible, so it must not need
        # more blocks to start computing once its KV is in (vLLM reserves them instead).
        copies = self.blocks.allocate(
            request.request_id, request.num_tokens, write_from=first * bs, hit_blocks=hits
        )
        if copies is None:
            return "refused"
        assert not copies  # a first allocation shares only full, unwritten hit blocks
        load = tuple(keys[:found])
        table = self.blocks.table(request.request_id)
        out.host_loads.append(
            HostLoad(
                request=request,
                keys=load,
                device_blocks=tuple(table[first : first + found]),
                slots=tuple(
                    self.host.prepare_load(
                        request.request_id,
                        load,
                        [(first + i + 1) * bs for i in range(found)],
                    )
                ),
            )
        )
        cached = (first + found) * bs
        self.blocks.record_query(request.num_tokens, first * bs)
        if first_admission:
            self.external_stats.queries += request.num_tokens - first * bs
            self.external_stats.hits += found * bs
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.host_load_tokens = cached
        request.host_load_done = False
        request.next_stored_block = first + found  # those are in the host tier already
        if request.num_cached_tokens is None:
            request.num_cached_tokens = cached
        return "loading"

    def _loaded_tokens(self, request: Request) -> int:
        """A completed load's tokens, now in the prefix cache (vLLM's
        ``_update_waiting_for_remote_kv``); at most all but the last token count as computed."""
        bs = self.blocks.block_size
        lora = (request.lora.lora_int_id, request.lora.name) if request.lora else None
        self.blocks.cache_full_blocks(
            request.request_id,
            request.block_hashes,
            request.host_load_tokens,
            request.token_ids,
            lora=lora,
        )
        assert request.host_load_tokens % bs == 0
        return min(request.host_load_tokens, request.num_tokens - 1)
