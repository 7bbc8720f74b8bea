"""The router in front of real CPU reference engines (fleetpilot.engine.reference.server):
unified replicas with prefix caching, and a disaggregated tier whose prefill and decode
servers hand KV over with vLLM's NIXL proxy protocol."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.api.router_config import EndpointGroup, RouterTier
from fleetpilot.testing.engine_server import BackgroundServer
from tests.routing.support import make_config, running_router

NIXL = '{"kv_connector": "NixlConnector", "kv_role": "%s"%s}'


def start(model: str, *extra: str) -> Any:
    argv = ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny",
            "--max-model-len", "512", "--served-model-name", model, *extra]  # fmt: skip
    return BackgroundServer.from_argv(argv).start()


def address(srv: Any) -> str:
    url = httpx.URL(srv.url)
    return f"{url.host}:{url.port}"


def metric(srv: Any, name: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


@pytest.fixture(scope="module")
def unified() -> Iterator[list[Any]]:
    servers = [start("small-model") for _ in range(2)]
    yield servers
    for srv in servers:
        srv.stop()


@pytest.fixture(scope="module")
def pd_pair() -> Iterator[tuple[Any, Any, Any]]:
    prefill = start("large-model", "--kv-transfer-config",
                    NIXL % ("kv_producer", ', "engine_id": "prefill-0"'))  # fmt: skip
    extra = ', "kv_connector_extra_config": {"allowed_remote_hosts": ["127.0.0.1"]}'
    decode = start("large-model", "--kv-transfer-config", NIXL % ("kv_consumer", extra))
    reference = start("large-model")
    yield prefill, decode, reference
    for srv in (prefill, decode, reference):
        srv.stop()


def group(role: str, servers: list[Any]) -> EndpointGroup:
    return EndpointGroup(
        role=role,
        service=f"svc-{role}",
        selector={},
        port=8000,
        max_num_seqs=64,
        addresses=[address(s) for s in servers],
    )


@pytest.mark.asyncio
async def test_openai_client_streams_from_reference_engines_with_prefix_affinity(
    unified: list[Any],
) -> None:
    """Streamed chat through the router from real engines; a conversation's turns stay on
    one replica, whose prefix cache then hits."""
    config = make_config(
        [RouterTier(name="small", model="small-model", up_to=1.0, mode="unified",
                    endpoints=[group("unified", unified)])],
        affinity={"blockChars": 16},
        debugRouteHeader=True,
    )  # fmt: skip
    hits_before = [metric(s, "vllm:prefix_cache_hits_total") for s in unified]
    async with running_router(config) as router:
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        try:
            messages: list[Any] = [
                {"role": "system", "content": "You answer questions about the fleet. " * 6}
            ]
            served = set()
            for turn in range(3):
                messages.append({"role": "user", "content": f"question number {turn}"})
                raw = await client.chat.completions.with_raw_response.create(
                    model="chat", messages=messages, max_tokens=4, stream=True, temperature=0
                )
                served.add(raw.headers["x-fleetpilot-route"].split("; ")[1])
                stream = raw.parse()
                text = "".join(
                    [c.choices[0].delta.content or "" async for c in stream if c.choices]
                )
                messages.append({"role": "assistant", "content": text})
        finally:
            await client.close()
        assert len(served) == 1
    hits_after = [metric(s, "vllm:prefix_cache_hits_total") for s in unified]
    assert sum(hits_after) > sum(hits_before)


@pytest.mark.asyncio
async def test_two_hops_through_reference_prefill_and_decode_servers(
    pd_pair: tuple[Any, Any, Any],
) -> None:
    """The router's P/D hops against real prefill (kv_producer) and decode (kv_consumer)
    servers: the decode server imports the prompt's KV instead of recomputing it, and the
    output equals a unified server's, streamed or not."""
    prefill, decode, reference = pd_pair
    config = make_config(
        [RouterTier(name="large", model="large-model", up_to=1.0, mode="disaggregated",
                    endpoints=[group("prefill", [prefill]), group("decode", [decode])])],
        debugRouteHeader=True,
    )  # fmt: skip
    request = {
        "model": "large-model",
        "prompt": "Disaggregated serving moves the prompt's KV cache from prefill to decode.",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    expected = httpx.post(reference.url + "/v1/completions", json=request, timeout=60).json()
    imported_before = metric(decode, "fleetpilot_kv_transfer_imported_tokens_total")
    async with running_router(config) as router:
        async with httpx.AsyncClient(timeout=60) as client:
            resp = await client.post(router.url + "/v1/completions", json=request)
            assert resp.status_code == 200, resp.text
            route = resp.headers["x-fleetpilot-route"]
            assert f"prefill={address(prefill)}" in route
            assert resp.json()["choices"][0]["text"] == expected["choices"][0]["text"]
            async with client.stream(
                "POST", router.url + "/v1/completions", json={**request, "stream": True}
            ) as streamed:
                assert streamed.status_code == 200
                body = (await streamed.aread()).decode()
            assert body.rstrip().endswith("data: [DONE]")
        assert router.metric("fleetpilot_router_pd_fallbacks_total", tier="large",
                             cause="prefill-no-kv-params") == 0  # fmt: skip
    assert metric(decode, "fleetpilot_kv_transfer_imported_tokens_total") > imported_before
