"""Routing on what the engines actually cache: real reference engines publishing vLLM KV
events, routers that subscribe to them and tokenize each request with the engines' own
tokenizer files. Two router processes that never saw each other's traffic choose the same
replica; an engine's eviction takes its replica out of the index while the guess still
claims the blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.api.router_config import EndpointGroup, RouterConfig, RouterTier
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.routing.discovery import FileSource
from fleetpilot.routing.features import extract_features
from fleetpilot.routing.policies.prefix import block_hashes
from fleetpilot.runtime.processes import free_port
from fleetpilot.testing.engine_server import BackgroundServer
from fleetpilot.testing.polling import eventually
from tests.routing.support import make_config, router_process, running_router, wait_for

MODEL = "small-model"
BLOCK_SIZE = 16


class Engine:
    """A reference engine publishing KV events on two free loopback ports."""

    def __init__(self, *extra: str) -> None:
        self.kv_ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
        events = (
            '{"enable_kv_cache_events": true, "publisher": "zmq", '
            f'"endpoint": "tcp://127.0.0.1:{self.kv_ports[0]}", '
            f'"replay_endpoint": "tcp://127.0.0.1:{self.kv_ports[1]}"}}'
        )
        argv = ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny",
                "--served-model-name", MODEL, "--block-size", str(BLOCK_SIZE),
                "--kv-events-config", events, *extra]  # fmt: skip
        self.server = BackgroundServer.from_argv(argv).start()

    @property
    def address(self) -> str:
        url = httpx.URL(self.server.url)
        return f"{url.host}:{url.port}"

    def entry(self) -> dict[str, Any]:
        return {"tier": "small", "role": "unified", "address": self.address,
                "kvEventsPort": self.kv_ports[0], "kvReplayPort": self.kv_ports[1]}  # fmt: skip


def write_endpoints(path: Path, engines: list[Engine]) -> Path:
    path.write_text(yaml.safe_dump({"endpoints": [e.entry() for e in engines]}))
    return path


def kv_config() -> RouterConfig:
    group = EndpointGroup(role="unified", service="svc", selector={}, port=8000, max_num_seqs=64)
    return make_config(
        [RouterTier(name="small", model=MODEL, up_to=1.0, mode="unified", endpoints=[group],
                    tokenizer=str(REFERENCE_TOKENIZER))],
        debugRouteHeader=True,
    )  # fmt: skip


def route_of(response: httpx.Response) -> dict[str, str]:
    assert response.status_code == 200, response.text
    parts = response.headers["x-fleetpilot-route"].split("; ")
    return dict(p.split("=", 1) for p in parts)


def conversation(n: int, turns: int) -> list[dict[str, str]]:
    """A distinct system prompt per conversation (so no two share a cached prefix) and
    ``turns`` user turns."""
    # The number first: it falls in the first block, so no two conversations share one.
    messages = [{"role": "system", "content": f"{n:04d} tenant instructions: be brief. " * 8}]
    for t in range(turns):
        if t:
            messages.append({"role": "assistant", "content": "ok"})
        messages.append({"role": "user", "content": f"question {t} about topic {n}"})
    return messages


def gauge(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


def cached_blocks(engines: list[Engine]) -> int:
    """The blocks the engines' prefix caches hold, which their KV events announced."""
    total = 0
    for e in engines:
        engine = e.server.server.engine
        assert engine is not None
        total += len(engine.blocks.cached)
    return total


def wait_until(predicate: Any, timeout_s: float = 20.0) -> None:
    eventually("the condition", lambda: True if predicate() else None, timeout_s, interval=0.05)


@pytest.fixture(scope="module")
def three_engines() -> Iterator[list[Engine]]:
    engines = [Engine() for _ in range(3)]
    yield engines
    for e in engines:
        e.server.stop()


def test_two_router_processes_route_a_conversation_to_the_replica_that_caches_it(
    three_engines: list[Engine], tmp_path: Path
) -> None:
    """Each conversation's first turn goes through one router process, its second through
    the other, which never saw the first: both read the engines' KV events, so the second
    turn lands where the first one's blocks are, judged by events."""
    config_path = tmp_path / "router.yaml"
    config_path.write_text(yaml.safe_dump(kv_config().to_wire()))
    endpoints = write_endpoints(tmp_path / "endpoints.yaml", three_engines)
    extra = ["--endpoints-file", str(endpoints), "--log-level", "warning"]
    with (
        router_process(config_path, extra=extra) as (_, port_a),
        router_process(config_path, extra=extra) as (_, port_b),
        httpx.Client(timeout=60) as client,
    ):
        ports = (port_a, port_b)
        for port in ports:  # every engine's publisher heard from (the replay from 0 answered)
            wait_until(lambda p=port: gauge(p, "fleetpilot_router_kv_events_live") == 3)
        for n in range(4):
            first, second = ports[n % 2], ports[1 - n % 2]
            body = {"model": MODEL, "messages": conversation(n, 1), "max_tokens": 2}
            one = route_of(client.post(f"http://127.0.0.1:{first}/v1/chat/completions", json=body))
            assert one["prefix-source"] == "events"
            # The other router learns the new blocks from the engine, not from the first: its
            # index holds every block the engines cache. (A count that merely grew could be the
            # last conversation's second turn arriving late, not this one's first.)
            wait_until(
                lambda s=second: (
                    gauge(s, "fleetpilot_router_kv_index_blocks") == cached_blocks(three_engines)
                )
            )
            body["messages"] = conversation(n, 2)
            two = route_of(client.post(f"http://127.0.0.1:{second}/v1/chat/completions", json=body))
            assert (two["replica"], two["prefix-source"]) == (one["replica"], "events")
            assert float(two["prefix-match"]) > 0.5


@pytest.mark.asyncio
async def test_an_evicted_prefix_leaves_the_index_while_the_guess_still_claims_it(
    tmp_path: Path,
) -> None:
    """An engine with a small KV pool evicts a prompt's blocks to serve others; its events
    remove them from the router's index (and the route says nothing is cached), where the
    router's own record of what it sent still predicts a hit."""
    engine = Engine("--num-gpu-blocks-override", "64", "--max-model-len", "512")
    try:
        endpoints = write_endpoints(tmp_path / "endpoints.yaml", [engine])
        config = kv_config()
        async with (
            running_router(config, FileSource(endpoints)) as router,
            httpx.AsyncClient(timeout=60) as client,
        ):
            state = router.state
            await wait_for(lambda: state.kv_events is not None and state.kv_events.has_events(
                engine.address), timeout_s=20)  # fmt: skip
            await wait_for(lambda: "small" in state.router.tokenizers, timeout_s=20)
            # What a client that cannot see the router's state (a benchmark, an operator)
            # waits on before trusting its prefix routing.
            loaded = state.metrics.registry.get_sample_value(
                "fleetpilot_router_tokenizer_loaded", {"tier": "small"}
            )
            assert loaded == 1.0
            tokenizer = state.router.tokenizers["small"]
            messages = conversation(0, 1)
            keys = tokenizer.keys("chat", {"messages": messages}, BLOCK_SIZE)
            assert len(keys) >= 8
            url = router.url + "/v1/chat/completions"
            await client.post(url, json={"model": MODEL, "messages": messages, "max_tokens": 2})
            await wait_for(lambda: state.kv_index.match_keys(keys).get(engine.address) == len(keys))
            for n in range(1, 8):  # ~22 blocks each: they outgrow the 64-block pool
                other = {"model": MODEL, "messages": conversation(n, 1), "max_tokens": 2}
                route_of(await client.post(url, json=other))
            await wait_for(lambda: engine.address not in state.kv_index.match_keys(keys))
            features = extract_features({"messages": messages}, "chat")
            hashes = block_hashes(features.prompt_text, MODEL, config.affinity.block_chars)
            assert state.router.prefix_index.matched_blocks(engine.address, hashes) == len(hashes)
            body = {"model": MODEL, "messages": messages, "max_tokens": 2}
            route = route_of(await client.post(url, json=body))
            assert (route["prefix-source"], route["prefix-match"]) == ("events", "0.00")
    finally:
        engine.server.stop()


@pytest.mark.asyncio
async def test_a_prompt_the_device_evicted_is_routed_on_as_a_host_hit(tmp_path: Path) -> None:
    """Issue 46 end to end: an engine with a 64-block device pool and a host tier
    (``--kv-offloading-size``, self-describing events) evicts a prompt from its device to serve
    others; its host tier keeps it. The router's index, fed the engine's GPU and CPU events,
    holds the prompt as host blocks, and routing it again says so: ``kv-blocks`` counts its
    blocks as host, none computed, and the engine indeed serves them from its cache."""
    extra = '{"kv_connector_extra_config": {"self_describing_kv_events": true}}'
    engine = Engine(
        "--num-gpu-blocks-override", "64", "--max-model-len", "512",
        "--kv-offloading-size", "0.05", "--kv-transfer-config", extra,
    )  # fmt: skip
    try:
        endpoints = write_endpoints(tmp_path / "endpoints.yaml", [engine])
        async with (
            running_router(kv_config(), FileSource(endpoints)) as router,
            httpx.AsyncClient(timeout=60) as client,
        ):
            state = router.state
            await wait_for(lambda: state.kv_events is not None and state.kv_events.has_events(
                engine.address), timeout_s=20)  # fmt: skip
            await wait_for(lambda: "small" in state.router.tokenizers, timeout_s=20)
            keys = state.router.tokenizers["small"].keys(
                "chat", {"messages": conversation(0, 1)}, BLOCK_SIZE
            )
            url = router.url + "/v1/chat/completions"
            body = {"model": MODEL, "messages": conversation(0, 1), "max_tokens": 2}
            first = route_of(await client.post(url, json=body))
            assert first["kv-blocks"] == f"device:0,host:0,computed:{len(keys)}"

            def host_run() -> int:
                match = state.kv_index.match_tiers(keys)
                return match.host.get(engine.address, 0)

            for n in range(1, 8):  # ~22 blocks each: they outgrow the 64-block device pool
                other = {"model": MODEL, "messages": conversation(n, 1), "max_tokens": 2}
                route_of(await client.post(url, json=other))
            await wait_for(lambda: host_run() == len(keys), timeout_s=20)
            state.router.affinity.recent.retain(())  # what it sent lately is not the question
            response = await client.post(url, json=body)
            again = route_of(response)
            assert again["kv-blocks"] == f"device:0,host:{len(keys)},computed:0"
            cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == len(keys) * BLOCK_SIZE
    finally:
        engine.server.stop()
