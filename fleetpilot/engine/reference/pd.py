"""The prefill/decode KV hand-off between two reference engines (vLLM's NIXL proxy protocol).

The contract: the router sends a request to a prefill engine with
``kv_transfer_params.do_remote_decode`` (and ``max_tokens: 1``), then sends the same request,
carrying the ``kv_transfer_params`` that engine answered, to a decode engine.

* prefill side (role ``prefill``/``both``): a request with ``do_remote_decode`` runs with
  ``pin_kv``; :func:`remote_prefill_params` is the response's ``kv_transfer_params``, saying where
  the prompt's KV waits (``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``,
  ``remote_host``, ``remote_port``, ``expires_at``). ``remote_host``/``remote_port`` are the
  address the caller reached the server on, unless ``kv_ip`` is set in ``--kv-transfer-config``.
  :func:`export_pinned` serves the pinned blocks to the decoder (kv_wire.py is the payload).
* decode side (role ``decode``/``both``): a request with ``do_remote_prefill`` first pulls the KV
  (:class:`KVPuller`: ``POST http://remote_host:remote_port/internal/kv/remote_request_id``,
  which also releases it), then runs with ``kv_import`` and so skips the prefill. A missing or
  expired pin, a failed pull or an unusable payload falls back to a local prefill, counted in
  ``fleetpilot_kv_transfer_fallbacks_total{reason}``: the output is the same, only slower.

Trust assumption: like vLLM's NIXL side channel, the hand-off is unauthenticated: a decode
server would connect to whatever host and port a request's ``kv_transfer_params`` name, and a
prefill server would hand pinned KV (and the prompt's token ids) to whoever knows the request
id. ``--allowed-remote-hosts`` (peers.py; default: loopback only) bounds both: a decode request
naming a host outside the list is refused with a 400 before any connection is made, and
``/internal/kv/`` answers 403 to callers whose address is not listed
(:func:`check_kv_caller`). In a cluster the engine's port must also be reachable only from the
router and its peers (the planner's NetworkPolicy). Pulls go only to the ``/internal/kv/`` path,
with a timeout and a size bound, and the payload is safetensors (no pickle), validated before
use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from yarl import URL

from fleetpilot.engine.reference.engine import LLMEngine
from fleetpilot.engine.reference.kv_wire import KV_ROUTE, deserialize_kv
from fleetpilot.engine.reference.metrics import ServerMetrics
from fleetpilot.engine.reference.peers import AllowedPeers
from fleetpilot.engine.reference.protocol import APIError, KVPullRequest, KVTransferParams
from fleetpilot.engine.reference.request import KVBlocks
from fleetpilot.engine.reference.runner import PinInfo
from fleetpilot.engine.reference.settings import KVTransferSettings

log = logging.getLogger(__name__)


# ---- prefill side --------------------------------------------------------------------------


def local_address(request: web.Request) -> tuple[str, int] | None:
    """The address the client connected to: where a decoder can reach this server too."""
    transport = request.transport
    if transport is None:
        return None
    sockname = transport.get_extra_info("sockname")
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return None
    return str(sockname[0]), int(sockname[1])


def remote_prefill_params(
    kv: KVTransferSettings, rid: str, pin: PinInfo | None, reached_at: tuple[str, int]
) -> dict[str, Any] | None:
    """A prefill response's ``kv_transfer_params``: where its decoder pulls the pinned KV.

    ``reached_at`` is the address the caller connected to (:func:`local_address`, else the
    server's own): a decoder reaches it too, unless ``kv_ip`` names another.
    """
    if pin is None:
        return None  # nothing pinned (aborted, or evicted at once): decode prefills
    # Every field vLLM's NIXL prefill side answers (``request_finished`` of its connector's
    # scheduler, checked by tests/contract/test_vllm_pd_wire.py), with its types: block ids
    # per KV-cache group (one group: full attention), one TP/DCP/PP rank, a pull ("READ")
    # producer, no D-side expiry. ``expires_at`` is ours: the pin's end in unix seconds.
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(pin.block_ids)],
        "remote_engine_id": kv.engine_id,
        "remote_request_id": rid,
        "remote_host": kv.advertise_host or reached_at[0],
        "remote_port": reached_at[1],
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": pin.num_tokens,
        "remote_blocks_expiry_time": None,
        "remote_registration_generation": 0,
        "transfer_mode": "pull",
        "expires_at": pin.expires_at,
    }


def check_kv_caller(request: web.Request, allowed: AllowedPeers) -> None:
    """Only listed peers may fetch or release pinned KV (it holds the prompt's tokens)."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    address = peer[0] if isinstance(peer, tuple) and peer else ""
    if not allowed.allows_caller(address):
        log.warning("refusing %s %s from %s (not in --allowed-remote-hosts)",
                    request.method, request.path, address or "an unknown peer")  # fmt: skip
        raise APIError(403, f"peer {address or '(unknown)'} may not access pinned KV")


def export_pinned(engine: LLMEngine, rid: str, req: KVPullRequest) -> KVBlocks | None:
    """A copy of ``rid``'s pinned KV, released when asked; None if there is none to serve.

    Runs on the engine thread (``EngineRunner.call``).
    """
    pinned = engine.pinned_kv(rid)
    # Expired pins are dropped at the next step; until then they must not be served.
    if pinned is None or pinned.expires_at <= engine.clock():
        return None
    if req.block_ids is not None and tuple(req.block_ids) != pinned.block_ids:
        return None
    blocks = engine.export_kv(rid)  # a copy: releasing below cannot change it
    if req.release:
        engine.release_kv(rid)
    return blocks


# ---- decode side ---------------------------------------------------------------------------


def max_kv_payload(engine: LLMEngine, max_model_len: int) -> int:
    """The most bytes a pull reads: never more than this engine's whole pool (a compatible
    payload is smaller), plus room for the header and token ids."""
    return engine.kv.nbytes + 8 * max_model_len + 1024 * 1024


class KVPuller:
    """Fetches (and releases) the prompt KV a prefill engine pinned; ``open`` on the event loop,
    then ``pull`` per request, then ``close``."""

    def __init__(self, kv: KVTransferSettings, metrics: ServerMetrics) -> None:
        self.kv = kv
        self.metrics = metrics
        self._client: aiohttp.ClientSession | None = None

    def open(self) -> None:
        self._client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.kv.pull_timeout_s)
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def pull(self, ktp: KVTransferParams, limit: int) -> KVBlocks | None:
        """The pinned KV ``ktp`` names, at most ``limit`` bytes; None means prefill here.

        APIError (400) when ``ktp`` names a source this engine may not connect to.
        """
        kv = self.kv
        host, port, remote_id = ktp.remote_host, ktp.remote_port, ktp.remote_request_id
        if not host or port is None or not remote_id:
            log.warning("kv_transfer_params without remote host/port/request id: prefilling")
            self.metrics.count_kv_fallback("not_found")
            return None
        if ktp.expires_at is not None and ktp.expires_at <= time.time():
            log.info("remote KV of %s expired before the pull: prefilling", remote_id)
            self.metrics.count_kv_fallback("not_found")
            return None
        # Refused before any connection: a body must not make this server a proxy into the
        # network it sits in. A 400 rather than a silent local prefill, so a misconfigured list
        # shows at once; still counted as "refused" so the series flags hostile hand-offs.
        if not kv.allowed_remote_hosts.allows_pull(host, port):
            log.warning("refusing to pull KV from %r:%r (not an allowed remote host)", host, port)
            self.metrics.count_kv_fallback("refused")
            raise APIError(
                400,
                f"kv_transfer_params.remote_host {host!r} port {port} is not an allowed KV "
                f"source (--allowed-remote-hosts {kv.allowed_remote_hosts})",
                param="kv_transfer_params.remote_host",
            )
        try:
            url = URL.build(
                scheme="http",
                host=host,
                port=port,
                path=KV_ROUTE + quote(remote_id, safe=""),
                encoded=True,
            )
        except (ValueError, TypeError) as e:
            log.warning("refusing to pull KV from an invalid address %r:%r", host, port)
            self.metrics.count_kv_fallback("refused")
            raise APIError(
                400,
                f"kv_transfer_params.remote_host {host!r} is not a valid address",
                param="kv_transfer_params.remote_host",
            ) from e
        body = KVPullRequest(
            engine_id=ktp.remote_engine_id, block_ids=ktp.block_ids(), release=True
        )
        assert self._client is not None, "open() first"
        try:
            async with self._client.post(url, json=body.model_dump()) as resp:
                if resp.status == 404:
                    log.info("remote KV of %s not found (expired or released)", remote_id)
                    self.metrics.count_kv_fallback("not_found")
                    return None
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                if resp.content_length is not None and resp.content_length > limit:
                    raise ValueError(f"payload of {resp.content_length} bytes exceeds {limit}")
                chunks: list[bytes] = []
                size = 0
                async for chunk in resp.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > limit:
                        raise ValueError(f"payload exceeds {limit} bytes")
                    chunks.append(chunk)
                payload = b"".join(chunks)
            loop = asyncio.get_running_loop()
            blocks = await loop.run_in_executor(None, deserialize_kv, payload)
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as e:
            log.warning("pulling KV of %s from %s:%s failed: %s", remote_id, host, port, e)
            self.metrics.count_kv_fallback("pull_failed")
            return None
        self.metrics.count_kv_pull()
        return blocks
