"""Prefill/decode disaggregation: the two request bodies of vLLM's NIXL proxy protocol (the one
its disaggregated-serving proxy example speaks), which vLLM's engines and the reference engine
both answer. Purely computational; ``proxy`` sends them.

Hop 1 goes to a prefill replica: the original request with ``max_tokens: 1``, ``stream: false``
and ``kv_transfer_params: {do_remote_decode: true}``; the engine computes the prompt's KV,
keeps the blocks pinned for a remote reader, and answers with ``kv_transfer_params`` naming
them. Hop 2 sends the original request, with those parameters, to a decode replica, which pulls
the blocks and generates.
"""

from __future__ import annotations

from typing import Any

KV_TRANSFER_PARAMS = "kv_transfer_params"

# What vLLM's disaggregated proxy example sends on the prefill hop: only do_remote_decode is
# set; the remote_* fields are filled in by the prefill engine's answer.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def client_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The client's request for an engine: the tier's model name, and no client-supplied
    ``kv_transfer_params``, which would make an engine pull KV from an address the client
    chose rather than one discovery found."""
    out = dict(body)
    out["model"] = model
    out.pop(KV_TRANSFER_PARAMS, None)
    return out


def prefill_request(body: dict[str, Any], model: str) -> dict[str, Any]:
    """Hop 1: compute the prompt's KV and one token, keep the KV for a remote decoder."""
    out = client_body(body, model)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out[KV_TRANSFER_PARAMS] = dict(PREFILL_KV_PARAMS)
    return out


def decode_request(
    body: dict[str, Any], model: str, kv_transfer_params: dict[str, Any]
) -> dict[str, Any]:
    """Hop 2: the original request, carrying the prefill replica's KV handle."""
    out = client_body(body, model)
    out[KV_TRANSFER_PARAMS] = kv_transfer_params
    return out


def kv_params_of(response: Any) -> dict[str, Any] | None:
    """The KV handle in a prefill answer; ``None`` if the answer carries none (an engine
    without a KV connector answers normally and the hop is treated as failed)."""
    if not isinstance(response, dict):
        return None
    params = response.get(KV_TRANSFER_PARAMS)
    if not isinstance(params, dict) or not params:
        return None
    return params
