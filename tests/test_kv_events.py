"""vLLM's KV-event wire format, as the reference engine writes it and the router reads it."""

from __future__ import annotations

import msgspec
import pytest

from fleetpilot.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    seq_bytes,
    seq_of,
)


def test_a_batch_is_an_array_of_tagged_maps_as_vllm_sends_it() -> None:
    """The payload is [ts, events, rank] with each event a map tagged by its type, and the
    fields vLLM's decoder requires (lora_id, medium, lora_name) present even when None: a
    missing one would make every vLLM-side consumer refuse our engine's events."""
    batch = EventBatch(
        ts=12.5,
        events=[
            BlockStored([b"h1", b"h2"], None, list(range(32)), 16, None, "GPU", None),
            BlockRemoved([7], "GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert (raw[0], raw[2]) == (12.5, 0)
    stored, removed, cleared = raw[1]
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [b"h1", b"h2"],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    assert cleared == {"type": "AllBlocksCleared"}
    assert decode_batch(encode_batch(batch)) == batch


def test_fields_a_newer_vllm_adds_are_ignored_and_a_missing_rank_is_none() -> None:
    """vLLM 0.33 sends group_idx, extra_keys ... and omits a None rank: still decodable."""
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": 0,
                "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
                "lora_name": None, "group_idx": 0, "extra_keys": None}]]
    )  # fmt: skip
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == [BlockStored([1], 0, [1, 2], 2, None, "GPU", None)]


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x93", msgspec.msgpack.encode([1.0, [{"type": "BlockEaten"}]]), b"not msgpack"],
)
def test_a_malformed_payload_raises_a_value_error(payload: bytes) -> None:
    """Garbage is refused with one exception type a consumer can count and drop."""
    with pytest.raises(msgspec.DecodeError):  # a ValueError
        decode_batch(payload)
    assert issubclass(msgspec.DecodeError, ValueError)


def test_sequence_frames_are_eight_big_endian_bytes() -> None:
    """Sequence numbers round-trip; the end-of-replay marker is -1; a short frame is refused."""
    assert seq_of(seq_bytes(258)) == 258
    assert seq_bytes(258) == b"\x00" * 6 + b"\x01\x02"
    assert seq_of(END_SEQ) == -1
    with pytest.raises(ValueError, match="8 bytes"):
        seq_of(b"\x01")
