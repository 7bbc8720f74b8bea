"""KV events on the wire are vLLM's: the reference engine's batches decode with vLLM's own
structs (``vllm/distributed/kv_events.py``), and what vLLM's publisher encodes, fields a newer
release adds included, decodes with the router's decoder (``fleetpilot.kv_events``)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq

from fleetpilot.engine.reference.kv_publisher import KVEventPublisher
from fleetpilot.engine.reference.tokenizer import ByteTokenizer
from fleetpilot.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    kv_events_config,
)
from fleetpilot.testing.engine_server import BackgroundServer
from fleetpilot.testing.polling import eventually
from tests.contract.conftest import VllmJudge
from tests.support.kv_replay import DEADLINE_S, replay

PROMPTS = (
    "The quick brown fox jumps over the lazy dog; the dog sleeps on, dreaming of foxes and hens!",
    "Pack my box with five dozen liquor jugs, said the sphinx of black quartz to the judge, twice",
)


def as_wire(value: Any) -> Any:
    """fleetpilot's decoded structs in the judge's JSON shape (bytes hashes as hex)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [as_wire(v) for v in value]
    return value


def event_fields(event: Any) -> dict[str, Any]:
    kind = type(event).__name__
    fields = {name: as_wire(getattr(event, name)) for name in event.__struct_fields__}
    return {"type": kind, **fields}


@pytest.fixture(scope="module")
def engine_payloads() -> Iterator[list[bytes]]:
    """Every batch a reference engine with 8 KV blocks published for two long prompts (the
    second evicts the first) and a prefix-cache reset, fetched by replay from seq 0."""
    config = json.dumps(kv_events_config("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="t"))
    server = BackgroundServer.from_argv(
        ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny", "--max-model-len",
         "256", "--num-gpu-blocks-override", "8", "--kv-events-config", config]
    ).start()  # fmt: skip
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            httpx.post(server.url + "/v1/completions", json=body, timeout=30).raise_for_status()
        runner = server.server.runner
        assert runner is not None
        publisher = server.server.kv_publisher
        assert isinstance(publisher, KVEventPublisher)
        before = publisher.published
        asyncio.run(runner.call(lambda engine: engine.reset_prefix_cache()))
        eventually(
            "the reset published",
            lambda: publisher.published,
            DEADLINE_S,
            until=lambda published: published > before,
            interval=0.01,
        )
        assert publisher.replay_endpoint is not None
        yield [payload for _, _, payload in replay(ctx, publisher.replay_endpoint, 0)]
    finally:
        ctx.destroy(linger=0)
        server.stop()


def test_the_reference_engines_batches_decode_with_vllms_structs(
    vllm_judge: VllmJudge, engine_payloads: list[bytes]
) -> None:
    """Each payload decodes with vLLM's KVEventBatch to exactly what the router's decoder
    reads from it; all three kinds of event occur, with the prompts' token ids in the stores."""
    kinds: set[str] = set()
    stored_tokens: list[int] = []
    assert engine_payloads
    for payload in engine_payloads:
        answer = vllm_judge.ask({"op": "kv_decode", "payload": base64.b64encode(payload).decode()})
        assert answer["ok"], answer["error"]
        ts, events, *rank = answer["batch"]
        ours = decode_batch(payload)
        assert ts == ours.ts
        assert rank == ([] if ours.data_parallel_rank is None else [ours.data_parallel_rank])
        assert events == [event_fields(e) for e in ours.events]
        kinds.update(e["type"] for e in events)
        stored_tokens += [t for e in events if e["type"] == "BlockStored" for t in e["token_ids"]]
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    first = ByteTokenizer().encode(PROMPTS[0])
    assert stored_tokens[:16] == first[:16]


def test_a_malformed_batch_is_refused_by_vllm_as_by_the_router(vllm_judge: VllmJudge) -> None:
    """The judge is strict: a BlockStored without vLLM's required fields fails to decode in
    vLLM too, so the round trip above cannot pass on a lenient decoder."""
    import msgspec

    bad = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [b"x"]}], 0])
    answer = vllm_judge.ask({"op": "kv_decode", "payload": base64.b64encode(bad).decode()})
    assert not answer["ok"]
    assert "parent_block_hash" in answer["error"]
    with pytest.raises(ValueError, match="parent_block_hash"):
        decode_batch(bad)


def test_what_vllms_publisher_encodes_the_router_decodes(vllm_judge: VllmJudge) -> None:
    """A batch built from vLLM's structs with the fields this release adds (group index, extra
    keys, locality), int and bytes hashes, and no rank, decodes with the router's decoder."""
    events = [
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32, b"\x02" * 32],
         "parent_block_hash": None, "token_ids": list(range(32)), "block_size": 16,
         "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
         "extra_keys": [None, None], "locality": "local"},
        {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": 6,
         "token_ids": list(range(16)), "block_size": 16, "lora_id": 3, "medium": "GPU",
         "lora_name": "sql-adapter"},
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]  # fmt: skip
    wire = [{k: as_wire(v) for k, v in e.items()} for e in events]
    answer = vllm_judge.ask({"op": "kv_encode", "ts": 12.5, "events": wire, "rank": None})
    assert answer["ok"], answer["error"]
    batch = decode_batch(base64.b64decode(answer["payload"]))
    assert batch.ts == 12.5
    assert batch.data_parallel_rank is None
    first, second, removed, cleared = batch.events
    assert isinstance(first, BlockStored)
    assert first.block_hashes == [b"\x01" * 32, b"\x02" * 32]
    assert first.token_ids == list(range(32))
    assert isinstance(second, BlockStored)
    assert (second.block_hashes, second.parent_block_hash) == ([7], 6)
    assert (second.lora_id, second.lora_name) == (3, "sql-adapter")
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [b"\x01" * 32]
    assert isinstance(cleared, AllBlocksCleared)
