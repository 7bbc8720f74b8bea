"""The KV hand-off's wire codec (kv_wire.py): safetensors payloads between engines."""

from __future__ import annotations

import pytest
import torch

from fleetpilot.engine.reference.kv_wire import deserialize_kv, serialize_kv
from fleetpilot.engine.reference.request import KVBlocks


@pytest.mark.parametrize("int8", [False, True])
def test_kv_payload_round_trip(int8: bool) -> None:
    """What a prefill engine exports is what its decoder imports: token ids, block ids, block
    size, the KV data and (for an int8 cache) its scales, bit for bit."""
    data = torch.randn(3, 2, 2, 16, 2, 8)
    scales = None
    if int8:
        data = (data * 50).to(torch.int8)
        scales = torch.rand(3, 2, 2, 16, 2)
    kv = KVBlocks(
        token_ids=tuple(range(20)), block_size=16, block_ids=(4, 9), data=data, scales=scales
    )
    back = deserialize_kv(serialize_kv(kv))
    assert back.token_ids == kv.token_ids
    assert back.block_ids == kv.block_ids
    assert back.block_size == 16
    assert torch.equal(back.data, data)
    assert (back.scales is None) == (scales is None)
    if scales is not None:
        assert back.scales is not None
        assert torch.equal(back.scales, scales)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"garbage",
        b"\xff" * 8 + b"{}",
        serialize_kv(
            KVBlocks((1, 2), 16, (0,), torch.zeros(1, 2, 2, 16, 1, 4))  # 2 blocks of data, 1 id
        ),
    ],
    ids=["empty", "garbage", "bad-header", "inconsistent"],
)
def test_malformed_kv_payloads_are_refused(payload: bytes) -> None:
    """A bad peer's payload is a ValueError (the decoder falls back to a local prefill), never
    a tensor of the wrong shape reaching an engine step."""
    with pytest.raises(ValueError):  # noqa: PT011 (any message: the decoder falls back)
        deserialize_kv(payload)
