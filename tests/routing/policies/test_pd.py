"""The P/D request bodies (vLLM's NIXL proxy protocol)."""

from __future__ import annotations

from typing import Any

import pytest

from fleetpilot.routing.policies.pd import (
    PREFILL_KV_PARAMS,
    client_body,
    decode_request,
    kv_params_of,
    prefill_request,
)

BODY = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 100,
    "max_completion_tokens": 100,
    "stream": True,
    "stream_options": {"include_usage": True},
    "kv_transfer_params": {"remote_host": "evil.example"},
}


def test_prefill_hop_asks_for_one_token_no_stream_and_remote_decode() -> None:
    """Hop 1: max_tokens 1, stream false, do_remote_decode, the tier's model name."""
    out = prefill_request(BODY, "large-m")
    assert out["model"] == "large-m"
    assert out["max_tokens"] == 1
    assert out["max_completion_tokens"] == 1
    assert out["stream"] is False
    assert "stream_options" not in out
    assert out["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert BODY["max_tokens"] == 100  # the original is untouched


def test_decode_hop_is_the_original_with_the_prefill_handle() -> None:
    """Hop 2: the client's request as sent (streaming and all), plus the KV handle."""
    params = {"remote_engine_id": "p0", "remote_block_ids": [1]}
    out = decode_request(BODY, "large-m", params)
    assert out["kv_transfer_params"] == params
    assert out["stream"] is True
    assert out["max_tokens"] == 100


def test_client_kv_transfer_params_never_reach_an_engine() -> None:
    """A client cannot point an engine at a KV source of its choosing."""
    assert "kv_transfer_params" not in client_body(BODY, "m")


@pytest.mark.parametrize(
    ("response", "params"),
    [
        ({"kv_transfer_params": {"remote_engine_id": "p"}}, {"remote_engine_id": "p"}),
        ({"kv_transfer_params": None}, None),
        ({"kv_transfer_params": {}}, None),
        ({"kv_transfer_params": "x"}, None),
        ({}, None),
        ([], None),
    ],
)
def test_kv_params_of(response: Any, params: Any) -> None:
    """Only a non-empty object is a KV handle; anything else fails the hop."""
    assert kv_params_of(response) == params
