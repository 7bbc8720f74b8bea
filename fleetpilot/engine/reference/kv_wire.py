"""The KV blocks a prefill engine hands to a decode engine, on the wire.

A decode engine ``POST``s to ``KV_ROUTE + <request id>`` on the prefill engine, which answers with
the prompt's ``KVBlocks`` as safetensors bytes: the tensors, plus string metadata naming the
format, the block size and the exporting pool's block ids. Safetensors (not pickle) so that a
payload from a peer can only ever be data; :func:`deserialize_kv` checks the shapes the engine
relies on before anything else reads them. Purely computational.
"""

from __future__ import annotations

import json

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fleetpilot.engine.reference.request import KVBlocks

KV_FORMAT = "fleetpilot-kv-v1"
# Where a prefill engine serves (POST) and releases (DELETE) a pinned prompt's KV.
KV_ROUTE = "/internal/kv/"


def serialize_kv(kv: KVBlocks) -> bytes:
    """``KVBlocks`` as safetensors bytes: tensors plus string metadata, no pickle."""
    tensors = {
        "data": kv.data.contiguous(),
        "token_ids": torch.tensor(kv.token_ids, dtype=torch.int64),
    }
    if kv.scales is not None:
        tensors["scales"] = kv.scales.contiguous()
    metadata = {
        "format": KV_FORMAT,
        "block_size": str(kv.block_size),
        "block_ids": json.dumps(list(kv.block_ids)),
    }
    return st_save(tensors, metadata=metadata)


def deserialize_kv(payload: bytes) -> KVBlocks:
    """Parse and shape-check a payload from ``serialize_kv``; ValueError if malformed.

    The engine checks the payload against the prompt and its own pool before using it; this
    checks what the engine assumes (consistent shapes), so a bad peer cannot crash a step.
    """
    try:
        tensors = st_load(payload)
        with_meta = _safetensors_metadata(payload)
    except (SafetensorError, ValueError, KeyError) as e:
        raise ValueError(f"not a KV payload: {e}") from e
    if with_meta.get("format") != KV_FORMAT:
        raise ValueError(f"unknown KV payload format {with_meta.get('format')!r}")
    try:
        block_size = int(with_meta["block_size"])
        block_ids = tuple(int(b) for b in json.loads(with_meta["block_ids"]))
        data = tensors["data"]
        token_ids = tensors["token_ids"]
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"incomplete KV payload: {e}") from e
    scales = tensors.get("scales")
    if data.dim() != 6 or data.shape[2] != len(block_ids) or data.shape[3] != block_size:
        raise ValueError(f"KV data of shape {tuple(data.shape)} does not match its metadata")
    if token_ids.dim() != 1 or token_ids.dtype != torch.int64:
        raise ValueError("token_ids must be a 1-d int64 tensor")
    if not 0 < token_ids.numel() <= len(block_ids) * block_size:
        raise ValueError("token_ids do not fit the blocks")
    if scales is not None and (
        tuple(scales.shape) != tuple(data.shape[:-1]) or scales.dtype != torch.float32
    ):
        raise ValueError("int8 scales do not match the KV data")
    return KVBlocks(
        token_ids=tuple(int(t) for t in token_ids.tolist()),
        block_size=block_size,
        block_ids=block_ids,
        data=data,
        scales=scales,
    )


def _safetensors_metadata(payload: bytes) -> dict[str, str]:
    # The header is an 8-byte little-endian length and a JSON object; its "__metadata__" holds
    # the string metadata (safetensors.torch.load drops it).
    if len(payload) < 8:
        raise ValueError("payload too short")
    n = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + n])
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("bad metadata")
    return {str(k): str(v) for k, v in meta.items()}
