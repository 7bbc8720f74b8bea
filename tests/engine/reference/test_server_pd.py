"""P/D disaggregation over HTTP: vLLM's NIXL proxy protocol between two reference servers.

Three servers on the same seeded tiny model: a unified one (the reference output), a prefill one
and a decode one. The test plays the router (vLLM's toy proxy): prefill with max_tokens 1 and
``do_remote_decode``, then the original request to the decoder with the returned params.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from fleetpilot.testing.engine_server import BackgroundServer
from fleetpilot.testing.polling import eventually
from tests.engine.reference.pd_support import (
    MODEL,
    NIXL,
    PREFILL_PARAMS,
    PROMPT,
    REQUEST,
    do_prefill,
    fallbacks,
    post,
    start,
    value,
)


@pytest.fixture(scope="module")
def unified() -> Iterator[BackgroundServer]:
    srv = start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def prefill() -> Iterator[BackgroundServer]:
    srv = start("--kv-transfer-config", NIXL % ("kv_producer", ', "engine_id": "prefill-0"'))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def decode() -> Iterator[BackgroundServer]:
    extra = ', "kv_connector_extra_config": {"allowed_remote_hosts": ["127.0.0.1"]}'
    srv = start("--kv-transfer-config", NIXL % ("kv_consumer", extra))
    yield srv
    srv.stop()


# Generous: waits end as soon as their condition holds, and a busy CI machine may deschedule
# an engine thread for seconds.
WAIT_S = 30.0


def test_two_hops_equal_one_unified_server_and_skip_the_prefill(
    unified: BackgroundServer, prefill: BackgroundServer, decode: BackgroundServer
) -> None:
    """The router's two hops (prefill with do_remote_decode, then decode with the returned
    kv_transfer_params) give the unified server's exact tokens, and the decoder computes no
    prompt token but the last; a replay of spent params falls back to a local prefill."""
    reference = post(unified, REQUEST)["choices"][0]
    assert reference["finish_reason"] == "length"
    prompt_len = len(reference["prompt_token_ids"])

    first = post(prefill, {**REQUEST, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
    assert first["choices"][0]["token_ids"] == reference["token_ids"][:1]
    params = first["kv_transfer_params"]
    # vLLM's NixlConnector fields, plus our expiry.
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-0"
    assert params["remote_request_id"] == first["id"]
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == httpx.URL(prefill.url).port
    # One list of block ids per KV-cache group (a dense model has one), as vLLM answers.
    [block_ids] = params["remote_block_ids"]
    assert len(block_ids) == math.ceil(prompt_len / 16)
    assert params["remote_num_tokens"] == prompt_len
    assert time.time() < params["expires_at"] <= time.time() + 60.0  # the default TTL
    exported_before = value(prefill.url, "fleetpilot_kv_transfer_exported_blocks_total")

    # The router's second hop, through the official client as a router would forward it.
    with openai.OpenAI(base_url=decode.url + "/v1", api_key="x", max_retries=0) as client:
        out = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True, "kv_transfer_params": params},
        )
    choice = out.choices[0]
    assert choice.text == reference["text"]
    assert choice.model_extra is not None
    assert choice.model_extra["token_ids"] == reference["token_ids"]
    assert out.usage is not None
    assert out.usage.prompt_tokens_details is not None
    # All but the last prompt token came over the wire: the decoder did not prefill.
    assert out.usage.prompt_tokens_details.cached_tokens == prompt_len - 1
    assert value(decode.url, "fleetpilot_kv_transfer_imported_tokens_total") == prompt_len - 1
    assert value(decode.url, "fleetpilot_kv_transfer_pulls_total") == 1
    assert value(decode.url, "vllm:prefix_cache_queries_total") == 0  # no local prefill lookup
    for reason in ("not_found", "pull_failed", "refused", "unusable"):
        assert fallbacks(decode.url, reason) == 0
    # The prefill engine publishes its counters after answering the export (between steps):
    # on a busy machine the decoder can finish first.
    eventually(
        "the exported blocks counted by the prefill server",
        lambda: value(prefill.url, "fleetpilot_kv_transfer_exported_blocks_total"),
        WAIT_S,
        until=lambda exported: exported - exported_before == len(block_ids),
        interval=0.02,
    )

    # The pull released the pin: replaying the same params finds nothing, prefills locally and
    # still answers the same.
    again = post(decode, {**REQUEST, "kv_transfer_params": params})
    assert again["choices"][0]["token_ids"] == reference["token_ids"]
    assert fallbacks(decode.url, "not_found") == 1
    assert value(decode.url, "fleetpilot_kv_transfer_imported_tokens_total") == prompt_len - 1


def test_chat_two_hops(
    unified: BackgroundServer, prefill: BackgroundServer, decode: BackgroundServer
) -> None:
    """Chat completions hand KV over too, also with block ids in one flat list (as vLLM
    before hybrid KV-cache groups sent them), and answer as the unified server does."""
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_completion_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    reference = post(unified, chat, "/v1/chat/completions")
    first = post(
        prefill,
        {**chat, "max_completion_tokens": 1, "kv_transfer_params": PREFILL_PARAMS},
        "/v1/chat/completions",
    )
    params = first["kv_transfer_params"]
    # vLLM before hybrid KV-cache groups sent one flat list of block ids: read as well.
    [params["remote_block_ids"]] = params["remote_block_ids"]
    out = post(decode, {**chat, "kv_transfer_params": params}, "/v1/chat/completions")
    assert out["choices"][0]["message"] == reference["choices"][0]["message"]
    prompt_len = out["usage"]["prompt_tokens"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_len - 1


def test_unknown_and_expired_pins_fall_back_to_local_prefill(
    unified: BackgroundServer, prefill: BackgroundServer, decode: BackgroundServer
) -> None:
    """An unknown request id, block ids that are not the pin's, or a pin past its TTL: the
    decoder prefills locally (same tokens, counted as not_found), and the prefill server frees
    an expired pin's blocks on its own."""
    reference = post(unified, REQUEST)["choices"][0]["token_ids"]
    before = fallbacks(decode.url, "not_found")

    unknown = {**do_prefill(prefill), "remote_request_id": "cmpl-does-not-exist"}
    out = post(decode, {**REQUEST, "kv_transfer_params": unknown})
    assert out["choices"][0]["token_ids"] == reference
    assert fallbacks(decode.url, "not_found") == before + 1

    stale_blocks = {**do_prefill(prefill)}
    stale_blocks["remote_block_ids"] = [[b + 1 for b in stale_blocks["remote_block_ids"][0]]]
    out = post(decode, {**REQUEST, "kv_transfer_params": stale_blocks})
    assert out["choices"][0]["token_ids"] == reference
    assert fallbacks(decode.url, "not_found") == before + 2

    short = start("--kv-transfer-config", NIXL % ("kv_producer", ""), "--kv-pin-ttl-seconds", "0.3")
    try:
        expired = do_prefill(short)
        # expires_at is unix time on this same machine: once it has passed, both the decoder
        # (before pulling) and the prefill server (before serving) see the pin as expired.
        eventually(
            "the pin's expiry passed",
            time.time,
            WAIT_S,
            until=lambda now: now > expired["expires_at"],
            interval=0.02,
        )
        out = post(decode, {**REQUEST, "kv_transfer_params": expired})
        assert out["choices"][0]["token_ids"] == reference
        assert fallbacks(decode.url, "not_found") == before + 3
        # Past its TTL the prefill server dropped the pin (and its blocks) on its own.
        resp = httpx.post(f"{short.url}/internal/kv/{expired['remote_request_id']}", json={})
        assert resp.status_code == 404
        # ... at its next idle tick, without any request to trigger a step.
        eventually(
            "the expired pin's blocks freed",
            lambda: value(short.url, "vllm:kv_cache_usage_perc"),
            WAIT_S,
            until=lambda usage: usage == 0,
            interval=0.02,
        )
    finally:
        short.stop()


def test_failed_and_refused_pulls_fall_back(
    unified: BackgroundServer, prefill: BackgroundServer, decode: BackgroundServer
) -> None:
    """A prefill server that is gone (pull_failed) or a payload for another prompt (unusable)
    falls back to a local prefill with the same tokens; a source outside the decoder's allowed
    hosts is a 400 (refused), each counted by reason."""
    reference = post(unified, REQUEST)["choices"][0]["token_ids"]
    params = do_prefill(prefill)

    # Nothing listens there: a port that was free a moment ago.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    dead = {**params, "remote_port": free_port}
    failed_before = fallbacks(decode.url, "pull_failed")
    out = post(decode, {**REQUEST, "kv_transfer_params": dead})
    assert out["choices"][0]["token_ids"] == reference
    assert fallbacks(decode.url, "pull_failed") == failed_before + 1

    # Not in the decoder's allowed_remote_hosts: refused without connecting (test_server_peers).
    refused_before = fallbacks(decode.url, "refused")
    elsewhere = {**params, "remote_host": "localhost"}
    resp = httpx.post(
        decode.url + "/v1/completions", json={**REQUEST, "kv_transfer_params": elsewhere}
    )
    assert resp.status_code == 400, resp.text
    assert fallbacks(decode.url, "refused") == refused_before + 1

    # A payload for another prompt is pulled but unusable: the engine prefills instead.
    unusable_before = fallbacks(decode.url, "unusable")
    other = do_prefill(prefill, {**REQUEST, "prompt": PROMPT.upper()})
    out = post(decode, {**REQUEST, "kv_transfer_params": other})
    assert out["choices"][0]["token_ids"] == reference
    assert fallbacks(decode.url, "unusable") == unusable_before + 1


def test_prefill_side_endpoints_and_role_checks(
    unified: BackgroundServer, prefill: BackgroundServer, decode: BackgroundServer
) -> None:
    """/internal/kv refuses another engine's id and releases a pin once; pinning needs a
    non-streaming request; servers without the matching role ignore the P/D parameters."""
    params = do_prefill(prefill)
    kv_url = f"{prefill.url}/internal/kv/{params['remote_request_id']}"
    wrong_engine = httpx.post(kv_url, json={"engine_id": "someone-else"})
    assert wrong_engine.status_code == 404
    assert wrong_engine.json()["error"]["code"] == 404
    assert httpx.delete(kv_url).json() == {"released": True}
    assert httpx.delete(kv_url).status_code == 404

    # Pinning needs a non-streaming response to carry the params.
    resp = httpx.post(
        prefill.url + "/v1/completions",
        json={**REQUEST, "stream": True, "kv_transfer_params": PREFILL_PARAMS},
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "kv_transfer_params"

    # Servers without the producer role ignore do_remote_decode, as vLLM without a connector.
    for srv in (unified, decode):
        plain = post(srv, {**REQUEST, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
        assert plain["kv_transfer_params"] is None
    # And a unified server ignores do_remote_prefill: no pull, no fallback counted.
    post(unified, {**REQUEST, "kv_transfer_params": do_prefill(prefill)})
    assert fallbacks(unified.url, "not_found") == 0
    assert value(unified.url, "fleetpilot_kv_transfer_pulls_total") == 0
