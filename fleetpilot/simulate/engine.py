"""One simulated engine replica: continuous batching with chunked prefill and a prefix cache.
No I/O: simulated time in, simulated events out.

The engine runs in steps (``profile.EngineCosts``), but the simulator does not visit each step:
between two events of a replica (an arrival, a prompt finished, a sequence finished) its batch
does not change, so every step of the interval costs the same and the interval is advanced in
one go - every running sequence gains ``interval / step`` tokens, the prefill queue
``interval / step x chunk`` prompt tokens, first come first served. A prompt finishes and a
sequence ends at a step's end; a request arrives at any time, and on a busy engine it waits for
the step under way to end before the scheduler sees it (vLLM schedules between steps): on
average half a step, which at a few milliseconds a step is a large share of a short prompt's
TTFT. A replica is visited three to four times a request, whatever its output length. The KV
tokens of a long decode grow between events; a replica is revisited at least every
:data:`REFRESH_STEPS` steps so that the step cost follows them.

What it models as vLLM does: a step batches every running sequence's next token with as many
waiting prompt tokens as ``max_num_batched_tokens`` leaves; a prompt is admitted while the batch
has a free sequence slot and the KV cache room for what it adds: its full blocks that no
admitted sequence holds yet, its partial last block and, as it decodes, its output - a prompt
block that many running sequences share (a tenant's system prompt) takes its room once, as in
vLLM's block pool; its leading blocks that the prefix cache holds (the same content keys the
router's KV index uses, :func:`~fleetpilot.routing.policies.kv_index.chain_keys`) are not
computed, and its blocks are cached once computed, least recently used ones evicted past the
cache's size (never one a sequence in the batch holds), each change published as a KV event.
The host tier (``engine.kvOffload``, vLLM's native CPU offloading) as vLLM runs it: every
computed prompt block is also written to host memory (least recently used ones evicted past
``host_kv_tokens``); a prompt's blocks past its device hit that host memory holds are copied
back into the device pool instead of computed, the prompt waiting for the copy
(``host_load_per_token_s`` a token) without holding up the batch, and its prefill then starts
at the end of the step under way; each host-tier change is published as vLLM's self-describing
KV events with medium ``CPU``.
Not modelled: preemption (a batch whose decodes outgrow the cache keeps running), speculative
decoding, and the cached blocks of generated text. The attention cost of a step still reads
every sequence's whole context (no cascade attention over shared prefixes).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetpilot.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, Event
from fleetpilot.simulate.profile import EngineCosts, EngineShape

# Revisit a busy replica at least this often, in steps, so the KV-token term of the step cost
# follows the running sequences' growth (64 steps add 64 tokens a sequence: a few percent of a
# chat's context).
REFRESH_STEPS = 64
_EPS = 1e-9
# A fraction of a step: an arrival this close to a step's end is taken at it.
_PHASE_EPS = 1e-6


@dataclass(eq=False, slots=True)
class Seq:
    """One request on one engine."""

    request: Any  # the fleet's record, opaque here
    prompt_tokens: int
    keys: Sequence[bytes]  # the prompt's chained block keys at the engine's block size
    token_ids: Sequence[int]  # for the KV events' BlockStored
    output_tokens: int  # tokens to generate here (1: a prefill-only hop)
    prefill: bool = True  # False: the KV arrives from a prefill replica (P/D decode)
    cached_tokens: int = 0
    host_tokens: int = 0  # of cached_tokens, those copied back from the host tier
    remaining_prefill: float = 0.0
    finish_v: float = 0.0
    join_v: float = 0.0
    context: int = 0  # KV tokens when it joined the decode batch
    admitted_s: float | None = None
    first_token_s: float | None = None
    done_s: float | None = None


# The fleet's callbacks: a sequence's first token (its time), and its end.
FirstToken = Callable[[Seq, float], None]
Done = Callable[[Seq, float], None]
Publish = Callable[[list[Event]], None]


@dataclass(eq=False)
class Engine:
    """One replica's batch, queue and prefix cache, advanced event to event."""

    name: str
    costs: EngineCosts
    shape: EngineShape
    on_first_token: FirstToken
    on_done: Done
    publish: Publish | None = None  # KV events, when the router reads them
    now: float = 0.0
    waiting: deque[Seq] = field(default_factory=deque)
    # Arrived during the step under way: the scheduler takes them at its end.
    arriving: list[Seq] = field(default_factory=list)
    prefilling: deque[Seq] = field(default_factory=deque)
    # (finish_v, tie, sequence): the running batch by the virtual token at which each ends.
    running: list[tuple[float, int, Seq]] = field(default_factory=list)
    # Tokens each running sequence has decoded since the engine started (all alike).
    v: float = 0.0
    # Context tokens of the running batch = k_base + len(running) x v (what attention reads).
    k_base: float = 0.0
    # The KV room the admitted sequences take: the full prompt blocks they hold (each once,
    # however many share it: ``block_refs``), and what is theirs alone - the running batch's
    # k_private + len(running) x v (partial last blocks and output), the prefill queue's
    # partial last blocks.
    block_refs: dict[bytes, int] = field(default_factory=dict)
    k_private: float = 0.0
    prefill_private: int = 0
    prefill_left: float = 0.0  # prompt tokens still to compute, over the prefill queue
    cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    host: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # the host tier's LRU
    # (copy done at, tie, sequence): admitted prompts waiting for their host blocks.
    loading: list[tuple[float, int, Seq]] = field(default_factory=list)
    step_s: float = 0.0
    chunk: float = 0.0
    # When the first step of the current plan began: its steps end at anchor_s + k x step_s.
    anchor_s: float = 0.0
    version: int = 0  # bumped whenever the next event time changes (lazy heap deletion)
    # Counters for the autoscaler's and the report's view.
    prompt_total: int = 0
    cached_total: int = 0
    host_cached_total: int = 0  # of cached_total, the tokens copied back from the host tier
    _tie: int = 0

    @property
    def cache_blocks(self) -> int:
        return self.shape.kv_tokens // self.shape.block_size

    @property
    def host_blocks(self) -> int:
        return self.shape.host_kv_tokens // self.shape.block_size

    @property
    def kv_tokens_used(self) -> float:
        return (
            len(self.block_refs) * self.shape.block_size
            + self.k_private
            + len(self.running) * self.v
            + self.prefill_private
        )

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.kv_tokens_used / self.shape.kv_tokens)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        # vLLM's scheduler counts a request once its engine core has taken it from the input
        # queue, between steps: one that arrived mid-step is not counted yet. A prompt waiting
        # for its host blocks is a waiting request too (vLLM's WAITING_FOR_REMOTE_KVS).
        return len(self.waiting) + len(self.loading)

    @property
    def idle(self) -> bool:
        return not (
            self.running or self.prefilling or self.waiting or self.arriving or self.loading
        )

    # -- the fleet's entry points ------------------------------------------------------------
    def submit(self, seq: Seq, now: float) -> float | None:
        """Queue a sequence; returns the replica's next event time (None: idle, or already
        asked for). Mid-step, the plan stands (the steps keep their phase) and the next event
        is the step's end, asked for once however many requests arrive during the step."""
        self._advance(now)
        step_end = self._step_end(now)
        if step_end is None:
            self.waiting.append(seq)
            return self._settle(now)
        self.arriving.append(seq)
        return step_end if len(self.arriving) == 1 else None

    def wake(self, now: float) -> float | None:
        """The event the replica asked for: finish what is due, admit, re-plan."""
        self._advance(now)
        return self._settle(now)

    # -- the model -----------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        dt = now - self.now
        self.now = now
        if dt <= 0 or self.step_s <= 0:
            return
        steps = dt / self.step_s
        if self.running:
            self.v += steps
        if self.prefilling:
            budget = steps * self.chunk
            self.prefill_left = max(0.0, self.prefill_left - budget)
            for seq in self.prefilling:
                take = min(seq.remaining_prefill, budget)
                seq.remaining_prefill -= take
                budget -= take
                if budget <= 0:
                    break

    def _step_end(self, now: float) -> float | None:
        """When the step under way ends; None when idle or between two steps."""
        if self.step_s <= 0:
            return None
        steps = (now - self.anchor_s) / self.step_s
        done = math.ceil(steps - _PHASE_EPS)
        if done - steps < _PHASE_EPS:
            return None
        return self.anchor_s + done * self.step_s

    def _settle(self, now: float) -> float | None:
        """Complete due prompts and sequences, admit waiting ones, and plan the next event.
        Only ever at a step's end (every planned event is one), so arrivals join the queue."""
        if self.arriving:
            self.waiting.extend(self.arriving)
            self.arriving.clear()
        while self.loading and self.loading[0][0] <= now + _EPS:
            _, _, seq = heapq.heappop(self.loading)
            self._start_prefill(seq)
        while True:
            progressed = False
            while self.prefilling and self.prefilling[0].remaining_prefill <= _EPS:
                self._prompt_done(self.prefilling.popleft(), now)
                progressed = True
            while self.running and self.running[0][0] <= self.v + _EPS:
                _, _, seq = heapq.heappop(self.running)
                self.k_base -= seq.context - seq.join_v
                self.k_private -= self._tail(seq) - seq.join_v
                self._release(seq)
                seq.done_s = now
                self.on_done(seq, now)
                progressed = True
            progressed |= self._admit(now)
            if not progressed:
                break
        return self._plan(now)

    def _admit(self, now: float) -> bool:
        admitted = False
        shape = self.shape
        while self.waiting and self.num_running + len(self.loading) < shape.max_num_seqs:
            seq = self.waiting[0]
            busy = self.running or self.prefilling or self.loading
            if busy and self.kv_tokens_used + self._room_needed(seq) > shape.kv_tokens:
                break  # no room for its KV until a running sequence ends
            self.waiting.popleft()
            seq.admitted_s = now
            admitted = True
            self._hold(seq)
            if not seq.prefill:
                # A decode hop's first token: one step computing the prompt's last token over
                # the pulled KV, then the served path as any first token.
                hop = self.costs.decode_hop_s(seq.prompt_tokens)
                self._join(seq, now, first_token_after=hop + self._served_s())
                self._store(seq)
                continue
            device = self._match(seq.keys)
            # vLLM's connector looks in host memory only past the device hit.
            host = self._match_host(seq.keys, device)
            # vLLM computes at least the prompt's last token to sample the first output token.
            seq.cached_tokens = min((device + host) * shape.block_size, seq.prompt_tokens - 1)
            seq.host_tokens = max(0, seq.cached_tokens - device * shape.block_size)
            seq.remaining_prefill = float(seq.prompt_tokens - seq.cached_tokens)
            self.prompt_total += seq.prompt_tokens
            self.cached_total += seq.cached_tokens
            self.host_cached_total += seq.host_tokens
            self.prefill_private += self._tail(seq)
            copy_s = seq.host_tokens * self.costs.host_load_per_token_s
            if copy_s > 0:
                self._tie += 1
                heapq.heappush(self.loading, (now + copy_s, self._tie, seq))
            else:
                self._start_prefill(seq)
        return admitted

    def _start_prefill(self, seq: Seq) -> None:
        self.prefill_left += seq.remaining_prefill
        self.prefilling.append(seq)

    def _tail(self, seq: Seq) -> int:
        """The prompt's tokens past its full (keyed) blocks: its alone, never shared."""
        return seq.prompt_tokens - len(seq.keys) * self.shape.block_size

    def _room_needed(self, seq: Seq) -> int:
        """KV tokens admitting ``seq`` takes: its blocks no admitted sequence holds, its tail."""
        if self.kv_tokens_used + seq.prompt_tokens <= self.shape.kv_tokens:
            return seq.prompt_tokens  # room even unshared: skip the count
        refs = self.block_refs
        fresh = sum(1 for key in seq.keys if key not in refs)
        return fresh * self.shape.block_size + self._tail(seq)

    def _hold(self, seq: Seq) -> None:
        refs = self.block_refs
        for key in seq.keys:
            refs[key] = refs.get(key, 0) + 1

    def _release(self, seq: Seq) -> None:
        refs = self.block_refs
        for key in seq.keys:
            n = refs[key] - 1
            if n:
                refs[key] = n
            else:
                del refs[key]

    def _prompt_done(self, seq: Seq, now: float) -> None:
        self.prefill_private -= self._tail(seq)
        self._store(seq)
        self._join(seq, now, first_token_after=self._served_s())

    def _served_s(self) -> float:
        """The served path of a first token, with the streams this replica serves beside it."""
        return self.costs.served_s(len(self.running) + len(self.prefilling))

    def _join(self, seq: Seq, now: float, first_token_after: float) -> None:
        """The sequence's first token is out; it decodes its others in the running batch."""
        seq.first_token_s = now + first_token_after
        self.on_first_token(seq, seq.first_token_s)
        if seq.output_tokens <= 1:
            self._release(seq)
            seq.done_s = seq.first_token_s
            self.on_done(seq, seq.first_token_s)
            return
        seq.join_v = self.v
        seq.context = seq.prompt_tokens
        seq.finish_v = self.v + seq.output_tokens - 1
        self.k_base += seq.context - seq.join_v
        self.k_private += self._tail(seq) - seq.join_v
        self._tie += 1
        heapq.heappush(self.running, (seq.finish_v, self._tie, seq))

    def _plan(self, now: float) -> float | None:
        self.version += 1
        self.anchor_s = now
        n = len(self.running)
        if not n and not self.prefilling:
            self.step_s = 0.0
            self.chunk = 0.0
            return self.loading[0][0] if self.loading else None
        chunk = context = pairs = 0.0
        if self.prefilling:
            chunk = min(float(max(1, self.shape.max_num_batched_tokens - n)), self.prefill_left)
            context, pairs = self._attended(chunk)
        self.chunk = chunk
        costs = self.costs
        step = costs.step_s(n, self.k_base + n * self.v, chunk, context, pairs)
        self.step_s = step
        horizon = REFRESH_STEPS * step
        if n:
            horizon = min(horizon, (self.running[0][0] - self.v) * step)
        if chunk > 0:
            # A prompt is done at the end of the step that computes its last token: the
            # prompts one step's chunk covers finish together, as in vLLM. A prompt of several
            # chunks is revisited before its last, smaller one (a cheaper step).
            steps = math.ceil(self.prefilling[0].remaining_prefill / chunk - _EPS)
            if steps > 1 and self._attends:
                steps = 2  # each chunk attends to more: re-priced step by step
            horizon = min(horizon, (steps - 1 if steps > 1 else 1) * step)
        if self.loading:
            # A copy that ends mid-step is seen by the scheduler at the step's end.
            steps = math.ceil((self.loading[0][0] - now) / step - _PHASE_EPS)
            horizon = min(horizon, max(1, steps) * step)
        return now + max(horizon, 0.0)

    @property
    def _attends(self) -> bool:
        return self.costs.prefill_per_context_token_s + self.costs.prefill_per_pair_s > 0

    def _attended(self, chunk: float) -> tuple[float, float]:
        """What the step's prompt tokens attend to, first come first served as the chunk
        covers the queue: each prompt's tokens already in the KV cache (its cached prefix and
        earlier chunks), and the pairs new x (prior + new / 2)."""
        if not self._attends:
            return 0.0, 0.0
        context = pairs = 0.0
        left = chunk
        for seq in self.prefilling:
            take = min(seq.remaining_prefill, left)
            prior = seq.prompt_tokens - seq.remaining_prefill
            context += prior
            pairs += take * (prior + take / 2)
            left -= take
            if left <= _EPS:
                break
        return context, pairs

    # -- prefix cache --------------------------------------------------------------------------
    def _match(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of the prompt the cache holds (touched: most recently used)."""
        cache = self.cache
        matched = 0
        for key in keys:
            if key not in cache:
                break
            cache.move_to_end(key)
            matched += 1
        return matched

    def _match_host(self, keys: Sequence[bytes], start: int) -> int:
        """Blocks of the prompt from ``start`` on that the host tier holds, in a row."""
        host = self.host
        matched = 0
        for key in keys[start:]:
            if key not in host:
                break
            host.move_to_end(key)
            matched += 1
        return matched

    def _store(self, seq: Seq) -> None:
        """Cache the prompt's blocks (and write them to the host tier); publish what was
        stored and what it evicted."""
        cache = self.cache
        keys = seq.keys
        first_new = len(keys)
        for i, key in enumerate(keys):
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
                first_new = min(first_new, i)
        host_events = self._store_host(seq)
        if first_new == len(keys):
            if host_events and self.publish is not None:
                self.publish(host_events)
            return
        # A block a sequence in the batch holds is not evictable (vLLM frees a block to its
        # cache only when no request uses it).
        evicted = _evict(cache, self.cache_blocks, self.block_refs)
        if self.publish is None:
            return
        size = self.shape.block_size
        events: list[Event] = []
        if evicted:
            events.append(BlockRemoved(block_hashes=list(evicted), medium=None))
        new = list(keys[first_new:])
        events.append(
            BlockStored(
                block_hashes=list(new),
                parent_block_hash=keys[first_new - 1] if first_new else None,
                token_ids=list(seq.token_ids[first_new * size : len(keys) * size]),
                block_size=size,
                lora_id=None,
                medium=None,
                lora_name=None,
            )
        )
        self.publish(events + host_events)

    def _store_host(self, seq: Seq) -> list[Event]:
        """Write the prompt's blocks through to the host tier, evicting its least recently
        used ones past its size (never one of this prompt's); the KV events of what changed,
        host evictions first, each run of newly stored blocks with its parent (vLLM's
        self-describing events)."""
        limit = self.host_blocks
        if limit <= 0:
            return []
        host = self.host
        keys = seq.keys
        fresh: list[int] = []
        for i, key in enumerate(keys):
            if key in host:
                host.move_to_end(key)
            else:
                host[key] = None
                fresh.append(i)
        if not fresh:
            return []
        evicted = _evict(host, limit, set(keys))
        if self.publish is None:
            return []
        events: list[Event] = []
        if evicted:
            events.append(BlockRemoved(block_hashes=list(evicted), medium=MEDIUM_CPU))
        size = self.shape.block_size
        start = 0
        for j in range(1, len(fresh) + 1):
            if j < len(fresh) and fresh[j] == fresh[j - 1] + 1:
                continue
            first, last = fresh[start], fresh[j - 1] + 1
            events.append(
                BlockStored(
                    block_hashes=list(keys[first:last]),
                    parent_block_hash=keys[first - 1] if first else None,
                    token_ids=list(seq.token_ids[first * size : last * size]),
                    block_size=size,
                    lora_id=None,
                    medium=MEDIUM_CPU,
                    lora_name=None,
                )
            )
            start = j
        return events


def _evict(cache: OrderedDict[bytes, None], limit: int, kept: Collection[bytes]) -> list[bytes]:
    """Drop least recently used blocks until ``cache`` holds ``limit``; a block in ``kept`` is
    not evictable and goes back to the recent end. The blocks dropped, oldest first."""
    evicted: list[bytes] = []
    passes = len(cache)
    while len(cache) > limit and passes > 0:
        passes -= 1
        key = cache.popitem(last=False)[0]
        if key in kept:
            cache[key] = None
        else:
            evicted.append(key)
    return evicted
