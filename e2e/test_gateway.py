"""fleetpilot's endpoint picker behind a gateway: the Go gateway (e2e/gateway, Envoy's side of
ext_proc for an InferencePool) in front of the router app's ``eppPort``, engine doubles behind
it, and the official ``openai`` client talking to the gateway. Every hop is a real process or
server: the client's HTTP, the gateway's gRPC stream to the picker, the gateway's HTTP to the
picked engine, the answer back through the picker."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from fleetpilot.runtime.processes import free_port
from fleetpilot.testing.gateway import Gateway, skip_reason
from tests.routing.support import (
    FakeEngine,
    RunningRouter,
    engines,
    make_config,
    route_of,
    running_router,
    tier,
    wait_for,
)

pytestmark = pytest.mark.asyncio

MESSAGES = [{"role": "user", "content": "Hello through the gateway"}]


@pytest.fixture(autouse=True)
def _gateway_can_run() -> None:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)


@dataclass
class Fleet:
    router: RunningRouter
    gateway: Gateway
    engines: list[FakeEngine]

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.gateway.url + "/v1", api_key="none", max_retries=0)

    def in_flight(self) -> list[int]:
        replicas = [self.router.state.router.replica(e.address) for e in self.engines]
        return [r.in_flight if r is not None else -1 for r in replicas]

    def served(self, engine: FakeEngine, status: str = "200") -> float:
        return self.router.metric(
            "fleetpilot_router_requests_total", tier="only", replica=engine.address, status=status
        )


@contextlib.asynccontextmanager
async def fleet(subset: Sequence[int] | None = None, **overrides: Any) -> AsyncIterator[Fleet]:
    """Two engines behind the picker behind the gateway (with ``subset``: the gateway sends
    those engines' addresses as the subset hint; ``overrides``: the router config's)."""
    async with engines(FakeEngine("a"), FakeEngine("b")) as started:
        port = free_port()
        config = make_config(
            [tier("only", 1.0, started)], eppPort=port, debugRouteHeader=True, **overrides
        )
        async with running_router(config) as router:
            hint = None if subset is None else [started[i].address for i in subset]
            picker = Gateway(f"127.0.0.1:{port}", subset=hint, tls=config.epp_tls)
            gateway = await asyncio.to_thread(picker.start)
            try:
                yield Fleet(router, gateway, started)
            finally:
                await asyncio.to_thread(gateway.stop)


async def test_the_openai_client_chats_through_the_gateway_whole_and_streamed() -> None:
    # Over TLS, as the operator configures the picker and a gateway connects to it.
    async with fleet(eppTls=True) as running, running.client() as client:
        reply = await client.chat.completions.create(model="chat", messages=MESSAGES)
        assert reply.choices[0].message.content in ("from a", "from b")
        stream = await client.chat.completions.create(model="chat", messages=MESSAGES, stream=True)
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        assert len(pieces) > 2
        await wait_for(lambda: running.in_flight() == [0, 0])
        assert sum(running.served(e) for e in running.engines) == 2
        # The engines were asked for the tier's model, which the picker wrote into the body.
        assert {r["model"] for e in running.engines for r in e.requests} == {"only-model"}


async def test_a_refusal_reaches_the_client_as_the_pickers_openai_error() -> None:
    async with fleet() as running, httpx.AsyncClient(timeout=20) as http:
        response = await http.post(
            running.gateway.url + "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == 400
        assert "not valid JSON" in error["message"]
        unknown = await http.post(
            running.gateway.url + "/v1/chat/completions",
            json={"model": "gpt-4", "messages": MESSAGES},
        )
        assert unknown.status_code == 404
        assert [len(e.requests) for e in running.engines] == [0, 0]


async def test_the_subset_hint_keeps_every_request_on_its_endpoints() -> None:
    async with fleet(subset=[1]) as running, running.client() as client:
        for _ in range(6):
            reply = await client.chat.completions.create(model="chat", messages=MESSAGES)
            assert reply.choices[0].message.content == "from b"
        assert (len(running.engines[0].requests), len(running.engines[1].requests)) == (0, 6)


async def test_a_dead_pick_falls_back_and_its_count_follows() -> None:
    """The engine holding a conversation's prefix dies while the router still lists it (its
    probes and scrapes slowed down, so it is not yet ejected): the picker picks it again with
    the other as fallback, the gateway's connection fails and it sends to the fallback, and
    tells the picker which endpoint served - where the request is then counted."""
    slow = {"interval": "60s", "timeout": "1s", "staleAfter": "120s"}
    async with (
        fleet(ejection={"probeInterval": "60s"}, scrape=slow) as running,
        running.client() as client,
    ):
        first = await client.chat.completions.create(model="chat", messages=MESSAGES)
        by_name = {e.name: e for e in running.engines}
        dead = by_name[str(first.choices[0].message.content).removeprefix("from ")]
        (alive,) = (e for e in running.engines if e is not dead)
        await dead.stop()
        again = await client.chat.completions.create(model="chat", messages=MESSAGES)
        assert again.choices[0].message.content == f"from {alive.name}"
        await wait_for(lambda: running.in_flight() == [0, 0])
        assert running.router.metric("fleetpilot_router_retries_total", tier="only") == 1
        assert (running.served(dead), running.served(alive)) == (1, 1)


async def test_the_route_header_comes_back_through_the_gateway() -> None:
    async with fleet() as running, httpx.AsyncClient(timeout=20) as http:
        response = await http.post(
            running.gateway.url + "/v1/chat/completions",
            json={"model": "chat", "messages": MESSAGES},
        )
        assert response.status_code == 200
        route = route_of(response.headers)
        assert route["tier"] == "only"
        assert route["replica"] in {e.address for e in running.engines}
        assert json.loads(response.text)["choices"][0]["message"]["content"] == (
            f"from {'a' if route['replica'] == running.engines[0].address else 'b'}"
        )


async def test_two_picker_replicas_each_decide_a_turn_of_the_requests() -> None:
    """Two routers as replicas of one picker: the gateway opens each request's stream on the
    next, as Envoy balances over a picker Service's endpoints; each counts what it decided."""
    async with engines(FakeEngine("a"), FakeEngine("b")) as started:
        ports = [free_port(), free_port()]
        configs = [make_config([tier("only", 1.0, started)], eppPort=port) for port in ports]
        async with running_router(configs[0]) as first, running_router(configs[1]) as second:
            pickers = [f"127.0.0.1:{port}" for port in ports]
            gateway = await asyncio.to_thread(Gateway(pickers).start)
            try:
                client = openai.AsyncOpenAI(
                    base_url=gateway.url + "/v1", api_key="none", max_retries=0
                )
                async with client:
                    for _ in range(4):
                        await client.chat.completions.create(model="chat", messages=MESSAGES)
            finally:
                await asyncio.to_thread(gateway.stop)
            decided = [
                sum(
                    router.metric(
                        "fleetpilot_router_requests_total",
                        tier="only",
                        replica=engine.address,
                        status="200",
                    )
                    for engine in started
                )
                for router in (first, second)
            ]
            assert decided == [2, 2]


async def test_without_a_picker_the_gateway_takes_the_endpoints_in_turn() -> None:
    async with engines(FakeEngine("a"), FakeEngine("b")) as started:
        gateway = await asyncio.to_thread(Gateway(endpoints=[e.address for e in started]).start)
        try:
            async with openai.AsyncOpenAI(
                base_url=gateway.url + "/v1", api_key="none", max_retries=0
            ) as client:
                answers = [
                    (await client.chat.completions.create(model="m", messages=MESSAGES))
                    .choices[0]
                    .message.content
                    for _ in range(4)
                ]
                stream = await client.chat.completions.create(
                    model="m", messages=MESSAGES, stream=True
                )
                pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        finally:
            await asyncio.to_thread(gateway.stop)
        assert answers == ["from a", "from b", "from a", "from b"]
        assert len(pieces) > 2
