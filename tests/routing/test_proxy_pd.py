"""Prefill/decode disaggregation through the router against fake prefill and decode engines
that check the NIXL proxy protocol: the prefill hop asks for one token with
``kv_transfer_params.do_remote_decode``, the decode hop carries the ``kv_transfer_params`` the
prefill engine answered."""

from __future__ import annotations

import json

import aiohttp
import pytest

from fleetpilot.api.router_config import RouterTier
from tests.routing.support import (
    FakeEngine,
    engines,
    group,
    make_config,
    running_router,
)

pytestmark = pytest.mark.asyncio

LONG = "You are a meticulous assistant for a large retail company. " * 10


def pd_tier(prefill: list[FakeEngine], decode: list[FakeEngine]) -> RouterTier:
    return RouterTier(
        name="large",
        model="large-model",
        up_to=1.0,
        mode="disaggregated",
        endpoints=[group(prefill, "prefill", service="p"), group(decode, "decode", service="d")],
    )


def route_of(headers: object) -> dict[str, str]:
    value = headers["x-fleetpilot-route"]  # type: ignore[index]
    return dict(part.split("=", 1) for part in value.split("; "))


async def test_two_hops_prefill_then_decode_with_the_kv_handle() -> None:
    """Hop 1 asks the prefill engine for one token with do_remote_decode; hop 2 streams the
    original request from the decode engine with the prefill's kv_transfer_params."""
    p, d = FakeEngine("p0", role="prefill"), FakeEngine("d0", role="decode", chunks=3)
    async with engines(p, d):
        config = make_config([pd_tier([p], [d])], debugRouteHeader=True)
        async with running_router(config) as router, aiohttp.ClientSession() as session:
            body = {
                "model": "chat",
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 50,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with session.post(router.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                text = await resp.text()
                route = route_of(resp.headers)
            assert text.count("d0-") == 3
            assert (route["tier"], route["replica"], route["prefill"]) == (
                "large",
                d.address,
                p.address,
            )
            (prefill_body,) = p.requests
            assert prefill_body["max_tokens"] == 1
            assert prefill_body["stream"] is False
            (decode_body,) = d.requests
            assert decode_body["kv_transfer_params"]["remote_engine_id"] == "p0"
            assert decode_body["kv_transfer_params"]["remote_port"] == p.port
            assert decode_body["stream"] is True
            assert decode_body["max_tokens"] == 50
            assert decode_body["stream_options"] == {"include_usage": True}
            assert decode_body["model"] == "large-model"
            # Both hops carry one request id, so the engines' logs can be joined.
            assert p.headers[0]["x-request-id"] == d.headers[0]["x-request-id"]


async def test_prefill_replica_is_chosen_by_prefix_affinity() -> None:
    """Repeated long prompts go to the prefill replica that already computed their prefix."""
    prefills = [FakeEngine(f"p{i}", role="prefill") for i in range(3)]
    d = FakeEngine("d0", role="decode")
    async with engines(*prefills, d):
        config = make_config([pd_tier(prefills, [d])], debugRouteHeader=True)
        async with running_router(config) as router, aiohttp.ClientSession() as session:
            chosen = set()
            for i in range(5):
                body = {"model": "chat", "prompt": LONG + f" question {i}", "max_tokens": 5}
                async with session.post(router.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    chosen.add(route_of(resp.headers)["prefill"])
                    served = await resp.json()
                    assert served["kv_transfer_params_seen"]["remote_engine_id"].startswith("p")
            assert len(chosen) == 1


@pytest.mark.parametrize(
    ("setup", "cause"),
    [
        ("5xx", "prefill-5xx"),
        ("killed", "prefill-connect"),
        ("no-params", "prefill-no-kv-params"),
        ("no-replicas", "no-prefill-replica"),
    ],
)
async def test_failed_prefill_hop_falls_back_to_unified_on_the_decode_replica(
    setup: str, cause: str
) -> None:
    """Whatever breaks the prefill hop, the decode replica serves the request whole (no KV
    handle) and the fallback is counted by cause."""
    p = FakeEngine("p0", role="prefill" if setup != "no-params" else "unified")
    d = FakeEngine("d0", role="decode")
    async with engines(p, d):
        if setup == "5xx":
            p.fail_next = 1
        prefill = [] if setup == "no-replicas" else [p]
        config = make_config([pd_tier(prefill, [d])])
        if setup == "killed":
            await p.stop()
        async with running_router(config) as router, aiohttp.ClientSession() as session:
            body = {"model": "chat", "prompt": LONG, "max_tokens": 5}
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert route_of(resp.headers)["prefill"] == "none"
                served = json.loads(await resp.text())
            assert served["served_by"] == "d0"
            assert "kv_transfer_params" not in d.requests[0]
            assert (
                router.metric("fleetpilot_router_pd_fallbacks_total", tier="large", cause=cause)
                == 1
            )
