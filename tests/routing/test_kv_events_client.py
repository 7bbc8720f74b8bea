"""The router's KV-event subscriptions over real ZMQ sockets: live batches, replay on join, on a
gap, on a dropped connection and after a publisher restart, garbage dropped and counted, silent
publishers reported, subscriptions following the set of replicas."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import pytest

from fleetpilot.engine.reference.kv_publisher import KVEventPublisher as EnginePublisher
from fleetpilot.engine.reference.kv_publisher import KVEventsConfig
from fleetpilot.kv_events import BlockRemoved, BlockStored, Event, EventBatch, seq_bytes
from fleetpilot.routing.kv_events_client import KVEventsClient
from fleetpilot.routing.metrics import RouterMetrics
from fleetpilot.routing.policies.kv_index import KVIndex
from tests.routing.support import KVEventPublisher, wait_for

pytestmark = pytest.mark.asyncio

BS = 4
A = list(range(100, 124))
B = list(range(500, 516))


def stored(hashes: list[Any], tokens: list[int], parent: Any = None) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, "GPU", None)


# One engine's history: chains built over several steps, a removal, a second prompt.
BATCHES: list[list[Event]] = [
    [stored([1, 2], A[:8])],
    [stored([3], A[8:12], parent=2)],
    [stored([10, 11], B[:8])],
    [BlockRemoved([11], "GPU")],
    [stored([4, 5], A[12:20], parent=3)],
    [stored([12], B[4:8], parent=10), BlockRemoved([1], "GPU")],
    [stored([6], A[20:24], parent=5)],
]


def built(replica: str, batches: Sequence[Sequence[Event]]) -> dict[str, frozenset[bytes]]:
    """The index that applying ``batches`` in order gives."""
    index = KVIndex()
    for events in batches:
        index.apply(replica, events)
    return index.snapshot()


def errors(client: KVEventsClient, replica: str, cause: str) -> float:
    value = client.metrics.registry.get_sample_value(
        "fleetpilot_router_kv_event_errors_total", {"replica": replica, "cause": cause}
    )
    return value or 0.0


def sample(client: KVEventsClient, name: str, labels: dict[str, str] | None = None) -> float:
    return client.metrics.registry.get_sample_value(name, labels or {}) or 0.0


@contextlib.asynccontextmanager
async def running(**kwargs: Any) -> AsyncIterator[tuple[KVEventPublisher, KVEventsClient]]:
    """A started publisher and a client (fast silence bounds; probes only every 10 s unless
    a test asks, so a gap is found by the live path, not by a probe)."""
    options: dict[str, Any] = {"silence_s": 30.0, "probe_s": 10.0, "replay_timeout_s": 0.5}
    options.update(kwargs)
    publisher = await KVEventPublisher().start()
    client = KVEventsClient(KVIndex(), RouterMetrics(), **options)
    try:
        yield publisher, client
    finally:
        await client.stop()
        await publisher.close()


async def publish_all(publisher: KVEventPublisher, batches: Sequence[Sequence[Event]]) -> None:
    for events in batches:
        await publisher.publish(*events)


async def test_live_batches_reach_the_index() -> None:
    """A subscribed router applies each published batch in order: its index is the engine's
    cache, the replica counts as publishing, and the events are counted."""
    async with running() as (publisher, client):
        client.set_endpoints({"a": publisher.endpoints})
        await publisher.wait_subscribed()
        await publish_all(publisher, BATCHES)
        await wait_for(lambda: client.next_seq("a") == len(BATCHES))
        assert client.index.snapshot() == built("a", BATCHES)
        assert client.index.match(A, BS) == {}  # its head block was removed
        assert client.index.match(B, BS) == {"a": 2}
        assert client.has_events("a")
        assert sample(client, "fleetpilot_router_kv_events_live", {"replica": "a"}) == 1
        events = sum(len(b) for b in BATCHES)
        assert sample(client, "fleetpilot_router_kv_events_total", {"replica": "a"}) == events
        assert sample(client, "fleetpilot_router_kv_index_blocks") == client.index.blocks
        assert errors(client, "a", "gap") == 0


async def test_a_late_subscriber_replays_from_zero() -> None:
    """A router that starts after the engine has cached blocks (a new router replica, a
    router restart) learns them by replaying the publisher's buffer from sequence 0."""
    async with running() as (publisher, client):
        await publish_all(publisher, BATCHES)
        client.set_endpoints({"a": publisher.endpoints})
        await wait_for(lambda: client.next_seq("a") == len(BATCHES))
        assert publisher.replay_requests[0] == 0
        assert client.index.snapshot() == built("a", BATCHES)
        assert client.index.match(B, BS) == {"a": 2}
        assert errors(client, "a", "lost") == 0


async def test_a_gap_in_sequence_numbers_is_replayed_before_newer_batches() -> None:
    """Batches the SUB socket never got (a dropped message) are fetched from the replay
    socket before the newer live batch is applied: the index equals one built from all
    batches in order (a removal of a block stored in the gap included)."""
    async with running() as (publisher, client):
        client.set_endpoints({"a": publisher.endpoints})
        await publisher.wait_subscribed()
        await publisher.publish(*BATCHES[0])
        await wait_for(lambda: client.next_seq("a") == 1)
        for events in BATCHES[1:4]:
            await publisher.publish(*events, send=False)
        await publish_all(publisher, BATCHES[4:])
        await wait_for(lambda: client.next_seq("a") == len(BATCHES))
        assert client.index.snapshot() == built("a", BATCHES)
        assert errors(client, "a", "gap") == 1
        assert errors(client, "a", "lost") == 0
        assert errors(client, "a", "restart") == 0


async def test_a_dropped_connection_replays_what_was_missed() -> None:
    """The publisher goes away and comes back on the same address (a network blip, a pod
    network restart) while the engine keeps caching: after reconnecting, the router replays
    the batches published while it was cut off and ends with the full index."""
    async with running() as (publisher, client):
        client.set_endpoints({"a": publisher.endpoints})
        await publisher.wait_subscribed()
        await publish_all(publisher, BATCHES[:3])
        await wait_for(lambda: client.next_seq("a") == 3)
        await publisher.stop()
        for events in BATCHES[3:5]:
            await publisher.publish(*events)  # nobody receives these
        await publisher.start()
        await publisher.wait_subscribed(2)
        await publish_all(publisher, BATCHES[5:])
        await wait_for(lambda: client.next_seq("a") == len(BATCHES))
        assert client.index.snapshot() == built("a", BATCHES)
        assert errors(client, "a", "gap") == 1
        assert errors(client, "a", "lost") == 0


async def test_a_restarted_publisher_clears_the_replica_and_replays_from_zero() -> None:
    """An engine restarted in place starts its sequence at 0 with an empty cache: the
    router forgets the replica's old blocks instead of treating seq 0 as old news."""
    async with running() as (publisher, client):
        client.set_endpoints({"a": publisher.endpoints})
        await publisher.wait_subscribed()
        await publish_all(publisher, BATCHES[:3])
        await wait_for(lambda: client.next_seq("a") == 3)
        await publisher.stop()
        await publisher.start(fresh=True)
        await publisher.wait_subscribed(2)
        await publisher.publish(stored([77], B[:4]))
        after = [[stored([77], B[:4])]]
        await wait_for(lambda: client.index.snapshot() == built("a", after))
        assert errors(client, "a", "restart") == 1
        assert client.next_seq("a") == 1


async def test_a_restart_whose_sequence_passed_ours_is_caught_by_the_replay_check() -> None:
    """A restarted engine that published more batches than the router had seen before the
    router reconnects: its sequence numbers look like a plain gap, but the replay's copy of
    the last batch applied differs, so the replica is cleared and rebuilt from 0."""
    async with running() as (publisher, client):
        client.set_endpoints({"a": publisher.endpoints})
        await publisher.wait_subscribed()
        await publish_all(publisher, BATCHES[:2])
        await wait_for(lambda: client.next_seq("a") == 2)
        await publisher.stop()
        await publisher.start(fresh=True)
        fresh = [[stored([90 + i], [i] * BS)] for i in range(5)]
        for events in fresh[:4]:
            await publisher.publish(*events, send=False)
        await publisher.wait_subscribed(2)
        await publisher.publish(*fresh[4])
        await wait_for(lambda: client.next_seq("a") == 5)
        assert client.index.snapshot() == built("a", fresh)
        assert errors(client, "a", "restart") == 1


async def test_garbage_is_counted_and_dropped_and_the_stream_goes_on() -> None:
    """Bytes that are not a batch, a batch of unknown event types, an oversize payload and
    messages with the wrong frames are each counted and dropped; the valid batches around
    them still build the right index and the subscriber keeps running."""
    async with running(max_payload_bytes=4096) as (publisher, client):
        client.set_endpoints({"a": publisher.endpoints})
        await publisher.wait_subscribed()
        await publisher.publish(*BATCHES[0])
        await publisher.publish_payload(b"\xc1 not msgpack")
        await publisher.publish_payload(msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]))
        await publisher.publish_payload(b"\x90" * 5000)
        await publisher.send_frames([b"", b"only two"])
        await publisher.send_frames([b"", b"seq", b"payload"])
        await publisher.send_frames([b"", seq_bytes(99), b"x", b"four"])
        for events in BATCHES[1:]:
            await publisher.publish(*events)
        await wait_for(lambda: client.next_seq("a") == len(BATCHES) + 3)
        assert client.index.snapshot() == built("a", BATCHES)
        assert errors(client, "a", "malformed") == 5
        assert errors(client, "a", "oversize") == 1
        assert errors(client, "a", "gap") == 0


async def test_an_inconsistent_event_and_an_unknown_parent_are_counted() -> None:
    """A BlockStored whose tokens do not fill its blocks, and one chained to a block the
    router never heard of, are counted by cause; the valid events of the batch still apply."""
    async with running() as (publisher, client):
        client.set_endpoints({"a": publisher.endpoints})
        await publisher.wait_subscribed()
        await publisher.publish(
            stored([1, 2], A[:7]), stored([3, 4], A[8:16], parent=999), stored([5], A[:4])
        )
        await wait_for(lambda: client.next_seq("a") == 1)
        assert errors(client, "a", "invalid_event") == 1
        assert errors(client, "a", "unknown_parent") == 2
        assert client.index.match(A, BS) == {"a": 1}


async def test_a_silent_publisher_is_reported_and_recovers() -> None:
    """A publisher that stops answering (engine down, network cut) marks its replica as
    having no events after the silence bound, counted once and shown on the gauge, so the
    router falls back to guessing for it; when it answers again the replica is live again.
    An idle but healthy publisher is not silent: it answers the probes."""
    async with running(silence_s=0.8, probe_s=0.1, replay_timeout_s=0.2) as (publisher, client):
        client.set_endpoints({"a": publisher.endpoints})
        await wait_for(lambda: client.has_events("a"))
        probes = len(publisher.replay_requests)
        await wait_for(lambda: len(publisher.replay_requests) >= probes + 10)
        assert client.has_events("a")  # idle for > silence_s, answering probes
        assert errors(client, "a", "silent") == 0
        await publisher.stop()
        await wait_for(lambda: not client.has_events("a"))
        await wait_for(lambda: errors(client, "a", "silent") == 1)
        assert sample(client, "fleetpilot_router_kv_events_live", {"replica": "a"}) == 0
        await publisher.start()
        await wait_for(lambda: client.has_events("a"))
        await wait_for(
            lambda: sample(client, "fleetpilot_router_kv_events_live", {"replica": "a"}) == 1
        )
        assert errors(client, "a", "silent") == 1


async def test_a_publisher_that_never_answers_has_no_events() -> None:
    """An engine whose publisher never answers is never trusted: no events, replays counted
    as timed out, reported silent once the bound has passed, and nothing in the index."""
    async with running(silence_s=0.3, probe_s=0.1, replay_timeout_s=0.1) as (publisher, client):
        publisher.answer_replays = False
        client.set_endpoints({"a": publisher.endpoints})
        await wait_for(lambda: errors(client, "a", "replay_timeout") >= 1)
        assert not client.has_events("a")
        await wait_for(lambda: errors(client, "a", "silent") == 1)
        assert sample(client, "fleetpilot_router_kv_events_live", {"replica": "a"}) == 0
        assert client.index.snapshot() == {}


async def test_subscriptions_follow_the_set_of_replicas() -> None:
    """Discovery adds and removes replicas: a new one is subscribed to, a departed one is
    unsubscribed and dropped from the index, the others keep their blocks, and a replica
    whose publisher address changed starts over from the new publisher."""
    async with running() as (first, client):
        second = await KVEventPublisher().start()
        try:
            await publish_all(first, BATCHES[:1])
            await publish_all(second, BATCHES[:1])
            client.set_endpoints({"a": first.endpoints})
            await wait_for(lambda: client.next_seq("a") == 1)
            client.set_endpoints({"a": first.endpoints, "b": second.endpoints})
            await wait_for(lambda: client.next_seq("b") == 1)
            assert client.index.match(A, BS) == {"a": 2, "b": 2}
            client.set_endpoints({"b": second.endpoints})
            assert client.replicas() == ["b"]
            assert client.index.replicas() == ["b"]
            assert client.index.match(A, BS) == {"b": 2}
            assert not client.has_events("a")
            await second.publish(*BATCHES[1])
            await wait_for(lambda: client.index.match(A, BS) == {"b": 3})
            client.set_endpoints({"b": first.endpoints})  # a new pod behind the same id
            assert client.index.match(A, BS) == {}
            await wait_for(lambda: client.index.match(A, BS) == {"b": 2})
        finally:
            await second.close()


async def test_the_reference_engines_publisher_is_read_as_it_writes() -> None:
    """The router's subscriber against the reference engine's own publisher (its PUB and
    ROUTER sockets, its thread): batches from before the subscription arrive by replay and
    later ones live, and the index is the one the batches describe."""
    publisher = EnginePublisher(
        KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint="tcp://127.0.0.1:0",
            replay_endpoint="tcp://127.0.0.1:0",
        )
    )
    client = KVEventsClient(KVIndex(), RouterMetrics(), probe_s=0.2)
    try:
        for events in BATCHES[:3]:
            assert publisher.publish(EventBatch(time.time(), list(events)))
        assert publisher.replay_endpoint is not None
        client.set_endpoints({"ref": (publisher.endpoint, publisher.replay_endpoint)})
        await wait_for(lambda: client.next_seq("ref") == 3)
        for events in BATCHES[3:]:
            assert publisher.publish(EventBatch(time.time(), list(events)))
        await wait_for(lambda: client.next_seq("ref") == len(BATCHES))
        assert client.index.snapshot() == built("ref", BATCHES)
        assert client.has_events("ref")
    finally:
        await client.stop()
        publisher.close()
