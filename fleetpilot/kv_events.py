"""vLLM's KV-cache events on the wire: what an engine publishes, what the router reads.

The wire format only, no I/O: the engines publish and the router subscribes over ZMQ elsewhere.

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`` tells the world which
prefix blocks it holds. The contract (vLLM 0.33, ``vllm/distributed/kv_events.py``):

- a ZMQ PUB socket sends three frames per batch: the topic, an 8-byte big-endian sequence
  number (0, 1, 2 ... per publisher), and a msgpack payload;
- the payload is an array ``[ts, events, data_parallel_rank]``; each event is a map tagged by
  its ``type``: ``BlockStored`` (``block_hashes`` of consecutive full blocks,
  ``parent_block_hash`` of the block before the first, their ``token_ids``, ``block_size``,
  ``lora_id``, ``medium``, ``lora_name``, always present; newer optional fields such as
  ``group_idx`` are ignored here), ``BlockRemoved`` (``block_hashes``, ``medium``) or
  ``AllBlocksCleared``; an absent ``data_parallel_rank`` is left out of the array;
- a ROUTER socket on ``replay_endpoint`` answers a request ``[b"", start_seq (8 bytes)]`` with
  every buffered batch from ``start_seq`` on, each as ``[b"", topic, seq, payload]``, then an
  end marker ``[b"", b"", END_SEQ, b""]`` (sequence -1).

The reference engine publishes these messages and the router decodes them, both through this
module; block hashes are opaque to the router (bytes or int, as vLLM allows), which keys its
index on the token ids instead.
"""

from __future__ import annotations

from typing import Any

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SEQ_BYTES = 8
# The tiers a block's ``medium`` names (vLLM's MEDIUM_*): the engine's device pool, host memory
# (the offloading connector's CPU tier, ``--kv-offloading-size``) and disk or object storage.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

# vLLM's ExternalBlockHash: a 64-bit int by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
# defaults to 1 in vLLM 0.33), the sha256 bytes when it is set to 0. The reference engine sends
# its 16-byte hashes; the router keys on token ids and takes either.
BlockHash = bytes | int


class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):
    """One change to an engine's prefix cache; the class name is the wire tag."""


class BlockStored(KVCacheEvent):
    """Full blocks that entered the prefix cache, in order, each the child of the one before
    (the first one's parent is ``parent_block_hash``, None at the start of a prompt)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    # Required on the wire (vLLM's decoder refuses a BlockStored without them), even when None.
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks whose contents the engine dropped (evicted for reuse)."""

    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The engine forgot its whole prefix cache (a reset)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one PUB message carries: the events of one engine step."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in ``payload``; raises ``msgspec.DecodeError`` (a ``ValueError``) for bytes
    that are not one, so a consumer can count and drop it."""
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def seq_of(frame: bytes) -> int:
    """The sequence number in a frame; raises ``ValueError`` for a frame of the wrong size."""
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"a sequence frame has {SEQ_BYTES} bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def kv_events_config(endpoint: str, replay_endpoint: str | None, topic: str = "") -> dict[str, Any]:
    """vLLM's ``--kv-events-config`` for a ZMQ publisher (the same JSON drives both engines)."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": topic,
    }
    if replay_endpoint is not None:
        config["replay_endpoint"] = replay_endpoint
    return config


__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "KVCacheEvent",
    "decode_batch",
    "encode_batch",
    "kv_events_config",
    "seq_bytes",
    "seq_of",
]
