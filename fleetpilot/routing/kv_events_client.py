"""The router's subscriptions to the engines' KV-event publishers, feeding a ``KVIndex``.

One asyncio task per engine (pyzmq's asyncio sockets, on the router's own loop, so the index is
only ever touched from that loop). Each task follows vLLM's publisher protocol
(``fleetpilot.kv_events``):

- a SUB socket receives ``[topic, seq, payload]``; batches are applied strictly in sequence;
- on first connect it asks the publisher's ROUTER replay socket for everything from 0 (a late
  joiner learns what the engine cached before it), and on a gap (a live ``seq`` beyond the next
  expected one: a dropped connection, a SUB queue overflow, the slow-joiner window) it replays
  from the next expected sequence before applying the live batch; live batches the replay
  already covered are skipped. A replay that starts later than asked (the publisher's buffer,
  10,000 batches in vLLM, has moved on) or fails counts the batches as ``lost`` and carries on;
- a live ``seq`` below the window a replay could have duplicated means the publisher restarted
  (its sequence starts at 0 again, and its cache is empty): the replica's index is cleared and
  replayed from 0. Every replay also asks for the last batch applied and compares its bytes,
  which catches a restarted publisher whose new sequence has already passed ours;
- a publisher quiet for ``probe_s`` is probed with a replay from the next expected sequence: an
  answer (the end marker, plus anything missed) proves it is up; one not heard from for
  ``silence_s`` (or, without a replay endpoint, one that published nothing that long) is marked
  "no events", and ``has_events`` tells the router to fall back to its guessed index for it;
- a malformed frame or payload, or a payload over ``max_payload_bytes``, is counted and dropped
  (its sequence still counts as seen: a replay would return the same bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from hashlib import blake2b

import zmq
import zmq.asyncio

from fleetpilot.kv_events import END_SEQ, decode_batch, seq_bytes, seq_of
from fleetpilot.routing.metrics import RouterMetrics
from fleetpilot.routing.policies.kv_index import KVIndex
from fleetpilot.routing.tasks import cancel

log = logging.getLogger(__name__)

# vLLM's largest batch is one engine step's events: a long prompt's BlockStored carries its
# token ids (4-5 bytes each in msgpack), so a 128k-token prefill is ~640 KB. 8 MiB leaves room
# for a step of several such prompts and still refuses to decode a payload meant to exhaust
# memory. Checked after receipt, not with ZMQ's MAXMSGSIZE: a SUB socket that refuses a
# message drops the connection and never reconnects (pyzmq 27), which would end the
# subscription for good.
MAX_PAYLOAD_BYTES = 8 << 20
# Live batches queued while a replay runs; beyond it ZMQ drops them and the next gap replays.
RCVHWM = 100_000
# One replay answers at most vLLM's whole buffer (10,000 batches); a peer that keeps sending
# beyond this is not a publisher, and the replay is abandoned.
MAX_REPLAY_BATCHES = 100_000
# Yield to the loop every this many replayed batches: a 10,000-batch replay must not stall
# request routing for its whole length.
REPLAY_YIELD_EVERY = 64


@dataclass(frozen=True)
class Publisher:
    """One engine's KV-event endpoints (``tcp://host:port``); no replay endpoint: gaps are lost."""

    endpoint: str
    replay_endpoint: str | None = None


class _Subscriber:
    """One engine's subscription; its state is touched only on the event loop."""

    def __init__(self, client: KVEventsClient, replica: str, publisher: Publisher) -> None:
        self.client = client
        self.replica = replica
        self.publisher = publisher
        self.next_seq = 0
        # Live batches in [dup_floor, next_seq) may be duplicates of a replay; a live batch
        # below dup_floor can only come from a restarted publisher.
        self.dup_floor = 0
        self.last_digest: bytes | None = None  # of the batch numbered next_seq - 1
        self.replays_answered = False  # has a replay ever returned a batch
        self.last_heard: float | None = None
        self.started = client.clock()
        self.live: bool | None = None  # None: not heard from yet, within the silence bound
        self.task: asyncio.Task[None] | None = None

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        c = self.client
        sub = c.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.SUBSCRIBE, c.topic)
        sub.connect(self.publisher.endpoint)
        try:
            if self.publisher.replay_endpoint is not None:
                await self.replay(self.next_seq)  # 0 on first connect: all the engine holds
            while True:
                if await sub.poll(timeout=round(c.probe_s * 1000)):
                    frames = await sub.recv_multipart()
                    await self.on_live(frames)
                elif self.publisher.replay_endpoint is not None:
                    await self.replay(self.next_seq, probe=True)
                self.update_liveness()
        finally:
            sub.close(linger=0)

    def update_liveness(self) -> None:
        """Live once heard from; silent (counted once a spell) when not heard from for the
        silence bound, counting a publisher never heard from since the subscription began."""
        c = self.client
        now = c.clock()
        heard = self.last_heard
        if heard is not None and now - heard <= c.silence_s:
            if self.live is not True:
                self.live = True
                c.metrics.kv_events_live.labels(self.replica).set(1)
        elif (
            self.live is not False
            and now - (self.started if heard is None else heard) > c.silence_s
        ):
            self.live = False
            c.metrics.kv_events_live.labels(self.replica).set(0)
            c.count(self.replica, "silent")
            log.warning("KV-event publisher silent", extra={"replica": self.replica})

    def heard(self) -> None:
        self.last_heard = self.client.clock()
        self.update_liveness()

    # -- live batches ------------------------------------------------------------------------
    async def on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.client.count(self.replica, "malformed")
            return
        try:
            seq = seq_of(frames[1])
        except ValueError:
            self.client.count(self.replica, "malformed")
            return
        self.heard()
        if seq < self.dup_floor:
            self.restarted()
            await self.recover()
        elif seq > self.next_seq:
            self.client.count(self.replica, "gap")
            await self.recover()
        if seq >= self.next_seq:  # not covered by a replay
            self.accept(seq, frames[2])
            self.dup_floor = self.next_seq

    async def recover(self) -> None:
        if self.publisher.replay_endpoint is not None:
            await self.replay(self.next_seq)

    def accept(self, seq: int, payload: bytes) -> None:
        """Apply the batch numbered ``seq`` (at or after ``next_seq``), counting what was
        skipped to reach it."""
        if seq > self.next_seq:
            self.client.count(self.replica, "lost", seq - self.next_seq)
        self.next_seq = seq + 1
        self.last_digest = _digest(payload)
        self.client.apply(self.replica, payload)

    # -- replay ------------------------------------------------------------------------------
    async def replay(self, start: int, *, probe: bool = False) -> bool:
        """Fetch and apply every buffered batch from ``start`` on; False if the publisher did
        not answer in time (the replay is abandoned; ``probe`` ones are not counted).

        The request starts one batch early, at the last one applied, to check that it is
        still the same publisher: the same process always still buffers its latest batch
        (vLLM keeps 10,000), so an answer without it, or with other bytes under its number,
        comes from a restarted engine whose cache is gone, even one whose new sequence has
        already passed ours.
        """
        restarted = await self._replay(start, probe=probe)
        if restarted:
            self.restarted()
            return await self._replay(0, probe=False) is not None
        return restarted is not None

    async def _replay(self, start: int, *, probe: bool) -> bool | None:
        """None: no answer in time; True: the publisher restarted (nothing applied from it);
        False: replayed."""
        c = self.client
        assert self.publisher.replay_endpoint is not None
        anchor = start - 1 if start > 0 and self.last_digest is not None else None
        dealer = c.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.publisher.replay_endpoint)
        timeout_ms = round(c.replay_timeout_s * 1000)
        received = 0
        if not probe:
            c.count(self.replica, "replay")
        try:
            await dealer.send_multipart([b"", seq_bytes(start if anchor is None else anchor)])
            while True:
                if not await dealer.poll(timeout=timeout_ms):
                    if not probe:
                        c.count(self.replica, "replay_timeout")
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[0] != b"":
                    c.count(self.replica, "malformed")
                    continue
                if frames[2] == END_SEQ:
                    self.heard()
                    if received:
                        self.replays_answered = True
                    # No batch at all, not even our last: a fresh publisher (unless this one
                    # keeps no buffer, which it shows by never having answered with a batch).
                    return anchor is not None and received == 0 and self.replays_answered
                try:
                    seq = seq_of(frames[2])
                except ValueError:
                    c.count(self.replica, "malformed")
                    continue
                received += 1
                if received > MAX_REPLAY_BATCHES:
                    c.count(self.replica, "malformed")
                    return None
                if seq == anchor:
                    if _digest(frames[3]) != self.last_digest:
                        self.replays_answered = True
                        return True
                elif seq >= self.next_seq:
                    self.accept(seq, frames[3])
                    if received % REPLAY_YIELD_EVERY == 0:
                        await asyncio.sleep(0)
        finally:
            dealer.close(linger=0)

    def restarted(self) -> None:
        """The publisher started over (a restarted engine, an empty cache): forget the
        replica's blocks and expect sequence 0."""
        self.client.count(self.replica, "restart")
        log.info("KV-event publisher restarted", extra={"replica": self.replica})
        self.client.index.clear(self.replica)
        self.next_seq = self.dup_floor = 0
        self.last_digest = None


def _digest(payload: bytes) -> bytes:
    return blake2b(payload, digest_size=16).digest()


class KVEventsClient:
    """Subscribes to every engine's KV events and keeps ``index`` up to date.

    ``set_endpoints`` (called on the event loop, e.g. whenever discovery changes) starts and
    stops subscriptions; ``has_events`` says whether the index speaks for a replica now.
    """

    def __init__(
        self,
        index: KVIndex,
        metrics: RouterMetrics,
        *,
        silence_s: float = 30.0,
        probe_s: float | None = None,
        replay_timeout_s: float = 2.0,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        topic: str = "",
        clock: Callable[[], float] = time.monotonic,
        on_stored: Callable[[str, list[bytes]], None] | None = None,
    ) -> None:
        self.index = index
        # Told, per stream, the content keys of the blocks each batch stored.
        self.on_stored = on_stored
        self.metrics = metrics
        self.silence_s = silence_s
        # Three probes fit in the silence bound, so one lost probe never marks a live
        # publisher silent.
        self.probe_s = probe_s if probe_s is not None else silence_s / 3
        self.replay_timeout_s = replay_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.topic = topic.encode()
        self.clock = clock
        self.ctx = zmq.asyncio.Context()
        self._subs: dict[str, _Subscriber] = {}
        self._retired: set[asyncio.Task[None]] = set()  # cancelled, still unwinding

    # -- endpoints ---------------------------------------------------------------------------
    def set_endpoints(self, publishers: Mapping[str, Publisher | tuple[str, str | None]]) -> None:
        """Follow this set of replicas: subscribe to new ones, unsubscribe from (and drop from
        the index) departed ones; a replica whose endpoints changed starts over."""
        wanted = {
            rid: p if isinstance(p, Publisher) else Publisher(p[0], p[1])
            for rid, p in publishers.items()
        }
        for rid in [r for r, s in self._subs.items() if wanted.get(r) != s.publisher]:
            self._forget(rid)
        for rid, publisher in wanted.items():
            if rid not in self._subs:
                sub = self._subs[rid] = _Subscriber(self, rid, publisher)
                sub.task = asyncio.create_task(self._guard(sub), name=f"kv-events {rid}")
        self.metrics.kv_index_blocks.set(self.index.blocks)

    def _forget(self, replica: str) -> None:
        sub = self._subs.pop(replica)
        if sub.task is not None:
            sub.task.cancel()  # at its next await: it applies nothing more
            self._retired.add(sub.task)
            sub.task.add_done_callback(self._retired.discard)
        self.index.drop(replica)
        with contextlib.suppress(KeyError):
            self.metrics.kv_events_live.remove(replica)

    async def _guard(self, sub: _Subscriber) -> None:
        """Run a subscription; one that raises is logged and restarted after a pause, never
        left dead for the life of the router."""
        while True:
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("KV-event subscriber failed", extra={"replica": sub.replica})
            await asyncio.sleep(self.probe_s)

    def replicas(self) -> list[str]:
        return list(self._subs)

    def has_events(self, replica: str) -> bool:
        """True while the replica's publisher is heard from: its index entries are the
        engine's truth. False for an unknown, silent or down one (fall back to guessing)."""
        sub = self._subs.get(replica)
        if sub is None or sub.last_heard is None:
            return False
        return self.clock() - sub.last_heard <= self.silence_s

    def next_seq(self, replica: str) -> int | None:
        """The next sequence number expected from the replica (tests and debugging)."""
        sub = self._subs.get(replica)
        return sub.next_seq if sub is not None else None

    async def stop(self) -> None:
        subs = list(self._subs.values())
        self._subs.clear()
        for task in [sub.task for sub in subs] + list(self._retired):
            await cancel(task)
        self.ctx.destroy(linger=0)

    # -- shared by the subscribers -----------------------------------------------------------
    def count(self, replica: str, cause: str, n: int = 1) -> None:
        self.metrics.kv_event_errors.labels(replica, cause).inc(n)

    def apply(self, replica: str, payload: bytes) -> None:
        """Decode one batch and apply it to the index; a bad one is counted and dropped."""
        if len(payload) > self.max_payload_bytes:
            self.count(replica, "oversize")
            return
        try:
            batch = decode_batch(payload)
        except ValueError:  # msgspec.DecodeError and ValidationError are ValueErrors
            self.count(replica, "malformed")
            return
        applied = self.index.apply(replica, batch.events)
        if applied.stored and self.on_stored is not None:
            self.on_stored(replica, applied.stored)
        self.metrics.kv_events.labels(replica).inc(applied.events)
        if applied.unknown_parent_blocks:
            self.count(replica, "unknown_parent", applied.unknown_parent_blocks)
        if applied.invalid_events:
            self.count(replica, "invalid_event", applied.invalid_events)
        if applied.placeholder_events:
            self.count(replica, "placeholder", applied.placeholder_events)
        self.metrics.kv_index_blocks.set(self.index.blocks)


__all__ = ["MAX_PAYLOAD_BYTES", "KVEventsClient", "Publisher"]
