"""The reference engine publishes vLLM's KV events: real engines, real pyzmq sockets, no mocks.

Each test starts an in-process engine (``BackgroundServer``) with ``--kv-events-config`` on
loopback ports and reads what it publishes the way the router does: a SUB socket on the PUB
endpoint, a DEALER on the ROUTER replay endpoint, payloads decoded with
``fleetpilot.kv_events.decode_batch``. Waits are on conditions with a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import zmq

from fleetpilot.engine.reference.blocks import extend_block_hashes, hash_block
from fleetpilot.engine.reference.engine import LLMEngine
from fleetpilot.engine.reference.kv_publisher import KVEventPublisher, KVEventsConfig
from fleetpilot.engine.reference.settings import ConfigError, add_arguments, settings_from_args
from fleetpilot.engine.reference.tokenizer import BOS_TOKEN_ID, ByteTokenizer
from fleetpilot.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    kv_events_config,
    seq_of,
)
from fleetpilot.runtime.processes import free_port
from fleetpilot.testing.engine_server import BackgroundServer
from fleetpilot.testing.polling import eventually
from tests.support.kv_replay import DEADLINE_S, connectable, replay

BLOCK = 16
TOPIC = "kv@test"
BASE_ARGS = [
    "--host", "127.0.0.1", "--port", "0", "--model-config", "tiny", "--max-model-len", "256",
]  # fmt: skip
# 90 bytes + BOS: five full blocks and a partial one.
PROMPT_A = (
    "The quick brown fox jumps over the lazy dog; the dog sleeps on, dreaming of foxes and hens!"
)
PROMPT_B = (
    "Pack my box with five dozen liquor jugs, said the sphinx of black quartz to the judge, twice"
)


def events_config(endpoint: str = "tcp://127.0.0.1:0", **extra: Any) -> str:
    config = kv_events_config(endpoint, "tcp://127.0.0.1:0", topic=TOPIC)
    return json.dumps({**config, **extra})


def start(*extra: str, endpoint: str = "tcp://127.0.0.1:0") -> BackgroundServer:
    argv = [*BASE_ARGS, "--kv-events-config", events_config(endpoint), *extra]
    return BackgroundServer.from_argv(argv).start()


def publisher(bg: BackgroundServer) -> KVEventPublisher:
    pub = bg.server.kv_publisher
    assert pub is not None, "the server was started without KV events"
    return pub


def engine(bg: BackgroundServer) -> LLMEngine:
    assert bg.server.engine is not None
    return bg.server.engine


def complete(bg: BackgroundServer, prompt: str, max_tokens: int = 2) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(bg.url + "/v1/completions", json=body, timeout=30)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


class Subscriber:
    """A SUB socket on an engine's PUB endpoint that keeps every batch it received, by seq."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.connect(connectable(endpoint))
        self.batches: list[tuple[int, EventBatch]] = []

    def _receive(self, wait_s: float) -> None:
        """Keep the next batch, waiting up to ``wait_s`` for it."""
        if self.sock.poll(int(wait_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == TOPIC.encode()
            self.batches.append((seq_of(seq), decode_batch(payload)))

    def until(self, done: Callable[[], bool], what: str) -> None:
        def received() -> list[tuple[int, EventBatch]]:
            if not done():
                self._receive(0.2)
            return self.batches

        # The probe itself waits on the socket: no sleep between rounds.
        eventually(what, received, DEADLINE_S, until=lambda _: done(), interval=0)

    def sync(self, pub: KVEventPublisher) -> None:
        """Return once every batch published before now has arrived: publish a marker batch
        (no events, ts -1) until one arrives (the first also waits out the SUB handshake)."""
        seen = len(self.batches)

        def arrived() -> bool:
            return any(b.ts == -1.0 for _, b in self.batches[seen:])

        def received() -> list[tuple[int, EventBatch]]:
            if not arrived():
                pub.publish(EventBatch(ts=-1.0, events=[], data_parallel_rank=0))
                self._receive(0.05)
            return self.batches[seen:]

        eventually("the marker batch", received, DEADLINE_S, until=lambda _: arrived(), interval=0)

    def events(self, since: int = 0) -> list[Any]:
        return [e for _, batch in self.batches[since:] for e in batch.events]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def subscribe(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[Callable[[str], Subscriber]]:
    """``subscribe(endpoint)``: a Subscriber, closed when the test ends."""
    made: list[Subscriber] = []

    def make(endpoint: str) -> Subscriber:
        made.append(Subscriber(ctx, endpoint))
        return made[-1]

    yield make
    for sub in made:
        sub.sock.close(linger=0)


def stored(events: list[Any]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


# ---- the engine's events on the PUB socket --------------------------------------------------


def test_a_request_publishes_block_stored_that_chains_to_the_engines_hashes(
    ctx: zmq.Context[zmq.Socket[bytes]],
    subscribe: Callable[[str], Subscriber],
) -> None:
    """A subscriber of a ``tcp://*:PORT`` publisher receives, for a prompt, BlockStored events
    whose token ids are the prompt as the engine held it (BOS, then its bytes), whose hashes
    recompute from parent + token ids, and are the engine's own prefix-cache hashes; batches
    carry rank 0 and consecutive sequence numbers."""
    # Free on every address, as the wildcard bind needs: a port free on 127.0.0.1 alone may be
    # the local port of a client socket on another address (any loopback load does that).
    port = free_port("0.0.0.0")
    bg = start(endpoint=f"tcp://*:{port}")
    try:
        pub = publisher(bg)
        assert pub.endpoint == f"tcp://0.0.0.0:{port}"
        sub = subscribe(f"tcp://127.0.0.1:{port}")
        sub.sync(pub)
        first = len(sub.batches)
        complete(bg, PROMPT_A)
        sub.sync(pub)
        blocks = stored(sub.events(first))
        assert blocks, "no BlockStored for the request"
        assert blocks[0].parent_block_hash is None
        tokens = [t for e in blocks for t in e.token_ids]
        prompt_ids = ByteTokenizer().encode(PROMPT_A)
        assert tokens[0] == BOS_TOKEN_ID
        full = len(prompt_ids) // BLOCK * BLOCK
        assert tokens[:full] == prompt_ids[:full]
        parent = None
        for event in blocks:
            assert (event.block_size, event.medium, event.lora_id, event.lora_name) == (
                BLOCK,
                "GPU",
                None,
                None,
            )
            assert event.parent_block_hash == parent
            assert len(event.token_ids) == BLOCK * len(event.block_hashes)
            for i, h in enumerate(event.block_hashes):
                parent = hash_block(parent, event.token_ids[i * BLOCK : (i + 1) * BLOCK])
                assert h == parent
        expected: list[bytes] = []
        extend_block_hashes(expected, prompt_ids, BLOCK)
        hashes = [h for e in blocks for h in e.block_hashes]
        assert hashes[: len(expected)] == expected
        assert set(hashes) <= set(engine(bg).blocks.cached)
        seqs = [seq for seq, _ in sub.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert all(b.data_parallel_rank == 0 for _, b in sub.batches)
    finally:
        bg.stop()
    # Closed with linger 0: the port is free again at once.
    again = ctx.socket(zmq.PUB)
    again.bind(f"tcp://127.0.0.1:{port}")
    again.close(linger=0)


def test_a_repeated_prompt_stores_nothing_new_for_its_cached_prefix(
    subscribe: Callable[[str], Subscriber],
) -> None:
    """The second identical prompt hits the prefix cache: no BlockStored repeats a hash of the
    prompt's blocks (only blocks holding newly generated tokens may appear)."""
    bg = start()
    try:
        pub = publisher(bg)
        sub = subscribe(pub.endpoint)
        sub.sync(pub)
        complete(bg, PROMPT_A, max_tokens=1)
        sub.sync(pub)
        first_hashes = {h for e in stored(sub.events()) for h in e.block_hashes}
        prompt_hashes: list[bytes] = []
        extend_block_hashes(prompt_hashes, ByteTokenizer().encode(PROMPT_A), BLOCK)
        assert set(prompt_hashes) <= first_hashes
        mark = len(sub.batches)
        result = complete(bg, PROMPT_A, max_tokens=1)
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        sub.sync(pub)
        again = {h for e in stored(sub.events(mark)) for h in e.block_hashes}
        assert not again & set(prompt_hashes)
    finally:
        bg.stop()


def test_eviction_in_a_tiny_kv_pool_publishes_block_removed(
    subscribe: Callable[[str], Subscriber],
) -> None:
    """With 8 KV blocks, a second long prompt reuses blocks that cached the first one: the
    engine publishes BlockRemoved for exactly hashes it had stored and no longer holds."""
    bg = start("--num-gpu-blocks-override", "8")
    try:
        pub = publisher(bg)
        sub = subscribe(pub.endpoint)
        sub.sync(pub)
        complete(bg, PROMPT_A)
        complete(bg, PROMPT_B)
        sub.sync(pub)
        events = sub.events()
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert removed, f"no BlockRemoved in {events}"
        assert all(e.medium == "GPU" for e in events if isinstance(e, BlockRemoved))
        stored_a: list[bytes] = []
        extend_block_hashes(stored_a, ByteTokenizer().encode(PROMPT_A), BLOCK)
        assert set(removed) <= {h for e in stored(events) for h in e.block_hashes}
        assert set(removed) & set(stored_a)
        assert not set(removed) & set(engine(bg).blocks.cached)
    finally:
        bg.stop()


def test_a_prefix_cache_reset_between_steps_publishes_all_blocks_cleared(
    subscribe: Callable[[str], Subscriber],
) -> None:
    """A reset run on the engine thread while the engine is idle (no step follows) still goes
    out, as AllBlocksCleared, and the same prompt is then stored again from its first block."""
    bg = start()
    try:
        pub = publisher(bg)
        sub = subscribe(pub.endpoint)
        sub.sync(pub)
        complete(bg, PROMPT_A, max_tokens=1)
        runner = bg.server.runner
        assert runner is not None
        asyncio.run(runner.call(lambda e: e.reset_prefix_cache()))
        sub.until(lambda: any(isinstance(e, AllBlocksCleared) for e in sub.events()), "clear")
        mark = len(sub.batches)
        complete(bg, PROMPT_A, max_tokens=1)
        sub.sync(pub)
        again = stored(sub.events(mark))
        assert again
        assert again[0].parent_block_hash is None
        assert again[0].token_ids[0] == BOS_TOKEN_ID
    finally:
        bg.stop()


# ---- replay ---------------------------------------------------------------------------------


def test_a_late_subscriber_replays_every_batch_from_zero_then_end_seq(
    ctx: zmq.Context[zmq.Socket[bytes]],
    subscribe: Callable[[str], Subscriber],
) -> None:
    """Nobody listens while two requests run; a subscriber that connects afterwards asks the
    ROUTER socket from seq 0 and gets every batch (0..n-1, the same topic, decodable, the
    prompts' blocks in them), then END_SEQ; asking from a later seq gets only the rest; the
    PUB socket continues at seq n."""
    bg = start()
    try:
        pub = publisher(bg)
        assert pub.replay_endpoint is not None
        complete(bg, PROMPT_A)
        complete(bg, PROMPT_B)
        eventually(
            "both steps' batches published (to nobody)",
            lambda: pub.published,
            DEADLINE_S,
            until=lambda n: n >= 2,
            interval=0.01,
        )
        n = pub.published
        batches = replay(ctx, pub.replay_endpoint, 0)
        assert [seq for _, seq, _ in batches] == list(range(n))
        assert {topic for topic, _, _ in batches} == {TOPIC.encode()}
        events = [e for _, _, payload in batches for e in decode_batch(payload).events]
        tokens = [t for e in stored(events) for t in e.token_ids]
        for prompt in (PROMPT_A, PROMPT_B):
            ids = ByteTokenizer().encode(prompt)
            head = ids[: len(ids) // BLOCK * BLOCK]
            assert any(tokens[i : i + len(head)] == head for i in range(len(tokens))), prompt
        assert [seq for _, seq, _ in replay(ctx, pub.replay_endpoint, n - 1)] == [n - 1]
        assert replay(ctx, pub.replay_endpoint, n + 5) == []
        sub = subscribe(pub.endpoint)
        sub.sync(pub)
        assert sub.batches[0][0] >= n
    finally:
        bg.stop()


def test_replay_buffer_keeps_only_the_last_buffer_steps_batches(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """``buffer_steps`` bounds the replay buffer: after 7 batches with a buffer of 3, a replay
    from 0 returns seqs 4, 5, 6; a malformed request is ignored and counted."""
    config = KVEventsConfig.from_json_dict(
        {**kv_events_config("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"), "buffer_steps": 3}
    )
    pub = KVEventPublisher(config)
    try:
        for _ in range(7):
            pub.publish(EventBatch(ts=1.0, events=[AllBlocksCleared()]))
        eventually(
            "7 batches published",
            lambda: pub.published,
            DEADLINE_S,
            until=lambda n: n >= 7,
            interval=0.01,
        )
        assert pub.replay_endpoint is not None
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(pub.replay_endpoint)
        bad.send_multipart([b"", b"\x00"])  # not an 8-byte sequence
        assert [seq for _, seq, _ in replay(ctx, pub.replay_endpoint, 0)] == [4, 5, 6]
        assert pub.bad_replay_requests == 1  # served in order: the bad one came first
    finally:
        bad.close()
        pub.close()


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    """``max_queue_size`` bounds what waits for the publisher thread: publishing into a full
    queue returns False at once and counts the batch as dropped; every batch is either sent
    (with consecutive sequence numbers) or counted, none lost silently."""
    config = KVEventsConfig.from_json_dict(
        {**kv_events_config("tcp://127.0.0.1:0", None), "max_queue_size": 1}
    )
    pub = KVEventPublisher(config)
    attempts = 0

    def publish_one() -> int:
        nonlocal attempts
        pub.publish(EventBatch(ts=1.0, events=[AllBlocksCleared()]))
        attempts += 1
        return pub.dropped

    try:
        eventually("a batch dropped", publish_one, DEADLINE_S, until=bool, interval=0)
    finally:
        pub.close()
    assert pub.published + pub.dropped == attempts
    assert pub.publish(EventBatch(ts=1.0, events=[])) is False  # closed


# ---- the flag -------------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model-config", "tiny", *argv])


def test_kv_events_are_off_by_default_and_follow_vllms_defaults() -> None:
    """Without the flag no events are recorded; the flag's defaults are vLLM's (endpoint
    tcp://*:5557, buffer 10000 steps, hwm and queue 100000, empty topic), and the "null"
    publisher records nothing either."""
    settings, factory = settings_from_args(parse())
    assert not settings.kv_events.active
    assert not factory().config.enable_kv_cache_events
    on, factory = settings_from_args(parse("--kv-events-config", '{"enable_kv_cache_events":true}'))
    assert on.kv_events.active
    assert factory().config.enable_kv_cache_events
    assert (on.kv_events.endpoint, on.kv_events.replay_endpoint) == ("tcp://*:5557", None)
    assert (on.kv_events.buffer_steps, on.kv_events.hwm, on.kv_events.max_queue_size) == (
        10_000,
        100_000,
        100_000,
    )
    assert on.kv_events.topic == ""
    null = '{"enable_kv_cache_events": true, "publisher": "null"}'
    assert not settings_from_args(parse("--kv-events-config", null))[0].kv_events.active


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "invalid JSON"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "endpont"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"max_queue_size": 0}', "max_queue_size"),
        ('{"endpoint": "localhost:5557"}', "endpoint"),
    ],
)
def test_bad_kv_events_config_is_refused_naming_the_flag(value: str, message: str) -> None:
    """Bad JSON, an unknown key, a wrong type or value: a ConfigError that names the flag and
    what is wrong, before anything starts."""
    with pytest.raises(ConfigError, match="--kv-events-config") as info:
        settings_from_args(parse("--kv-events-config", value))
    assert message in str(info.value)


def test_an_endpoint_in_use_fails_the_start_naming_the_flag(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A KV-event port another socket holds fails the server's start with the flag's name
    (the process exits 2), instead of an engine that silently publishes nothing."""
    holder = ctx.socket(zmq.PUB)
    holder.setsockopt(zmq.LINGER, 0)
    holder.bind("tcp://127.0.0.1:0")
    taken = holder.getsockopt_string(zmq.LAST_ENDPOINT)
    bg = BackgroundServer.from_argv([*BASE_ARGS, "--kv-events-config", events_config(taken)])
    with pytest.raises(ConfigError, match="--kv-events-config"):
        bg.start()
    bg.stop()
    holder.close()
