"""The endpoint picker end to end: the router app with ``eppPort``, real engine doubles on
loopback ports, and a gRPC client playing the gateway's side of ext_proc as GIE's hermetic
harness does - it sends the request's headers and body, reads the pick, sends the body to the
picked endpoint itself over HTTP, and passes the engine's answer back through the stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fleetpilot.api.router_config import AuthConfig, TenantKeys
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.kv_events import MEDIUM_CPU, BlockHash, BlockStored
from fleetpilot.routing.epp import protocol, tls
from fleetpilot.routing.policies.recent import RecentSends
from fleetpilot.routing.tokenizer.request import RequestTokenizer
from fleetpilot.runtime.processes import free_port
from tests.routing.support import (
    HARD,
    SHORT,
    FakeEngine,
    RunningRouter,
    engines,
    make_config,
    running_router,
    tier,
    wait_for,
)
from tests.routing.test_tokenize_off_loop import SYSTEM, RecordingTokenizer, tokenizer_tier

pytestmark = pytest.mark.asyncio

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "Hello there"}]}


def headers_message(
    path: str,
    headers: dict[str, str],
    *,
    end_of_stream: bool = False,
    subset: Sequence[str] | None = None,
) -> Any:
    """The request headers as Envoy sends them (pseudo-headers included, raw values)."""
    pairs = {":method": "POST", ":path": path, ":authority": "gateway", **headers}
    message = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()
                ]
            ),
            end_of_stream=end_of_stream,
        )
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({protocol.SUBSET_KEY: list(subset)})
        message.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].CopyFrom(hint)
    return message


def body_messages(body: bytes, chunk: int = 10) -> list[Any]:
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    return [
        ext_proc.ProcessingRequest(
            request_body=ext_proc.HttpBody(body=piece, end_of_stream=i == len(pieces) - 1)
        )
        for i, piece in enumerate(pieces)
    ]


def set_headers(response: Any) -> dict[str, str]:
    mutation = response.request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


@dataclass
class Picked:
    """What the picker answered a request: its endpoints and the body to send them."""

    response: Any  # the request-headers answer, or the immediate response
    body: bytes = b""
    endpoints: list[str] = field(default_factory=list)

    @property
    def immediate(self) -> Any:
        return self.response.immediate_response

    def error(self) -> tuple[int, dict[str, Any]]:
        assert self.response.WhichOneof("response") == "immediate_response", self.response
        return self.immediate.status.code, json.loads(self.immediate.body)


class Gateway:
    """Envoy's side of one ext_proc stream (one HTTP request)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = ext_proc_grpc.ExternalProcessorStub(channel).Process()

    async def request(
        self,
        body: bytes | dict[str, Any],
        path: str = "/v1/chat/completions",
        headers: dict[str, str] | None = None,
        subset: Sequence[str] | None = None,
    ) -> Picked:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json", **(headers or {})}
        await self.call.write(headers_message(path, headers, subset=subset))
        # Read while the body goes out: a refusal can come at the headers, and ends the stream.
        reply = asyncio.ensure_future(self.call.read())
        for message in body_messages(raw):
            await asyncio.wait([reply], timeout=0)
            if reply.done():
                break
            try:
                await self.call.write(message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                break  # the picker answered and closed the stream meanwhile
        first = await reply
        if first.WhichOneof("response") == "immediate_response":
            return Picked(first)
        assert first.WhichOneof("response") == "request_headers", first
        sent = set_headers(first)
        metadata = first.dynamic_metadata.fields[protocol.DESTINATION_NAMESPACE]
        in_metadata = metadata.struct_value.fields[protocol.DESTINATION_KEY].string_value
        assert in_metadata == sent[protocol.DESTINATION_KEY]  # the protocol's one rule
        assert first.request_headers.response.clear_route_cache
        upstream = b""
        while True:
            chunk = await self.call.read()
            streamed = chunk.request_body.response.body_mutation.streamed_response
            upstream += streamed.body
            if streamed.end_of_stream:
                break
        assert sent["content-length"] == str(len(upstream))
        return Picked(first, upstream, sent[protocol.DESTINATION_KEY].split(","))

    async def relay(
        self, picked: Picked, path: str = "/v1/chat/completions", served: str | None = None
    ) -> tuple[int, bytes]:
        """Send the picked body to the endpoint (``served``: a fallback instead) and pass
        the answer back through the picker, chunk by chunk; what the client gets."""
        endpoint = served or picked.endpoints[0]
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"http://{endpoint}{path}",
                data=picked.body,
                headers={"content-type": "application/json"},
            ) as resp,
        ):
            response_headers = {":status": str(resp.status), **resp.headers}
            message = ext_proc.ProcessingRequest(
                response_headers=ext_proc.HttpHeaders(
                    headers=base_pb2.HeaderMap(
                        headers=[
                            base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode())
                            for k, v in response_headers.items()
                        ]
                    )
                )
            )
            if served is not None:
                note = struct_pb2.Struct()
                note.update({protocol.SERVED_KEY: served})
                namespace = message.metadata_context.filter_metadata
                namespace[protocol.DESTINATION_NAMESPACE].CopyFrom(note)
            await self.call.write(message)
            answer = await self.call.read()
            assert answer.WhichOneof("response") == "response_headers"
            received = b""
            async for chunk in resp.content.iter_any():
                await self.call.write(
                    ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=chunk))
                )
                received += await self._echoed()
            await self.call.write(
                ext_proc.ProcessingRequest(
                    response_body=ext_proc.HttpBody(body=b"", end_of_stream=True)
                )
            )
            received += await self._echoed()
            await self.call.done_writing()
            return resp.status, received

    async def _echoed(self) -> bytes:
        echoed = await self.call.read()
        return bytes(echoed.response_body.response.body_mutation.streamed_response.body)


@dataclass
class Picker:
    router: RunningRouter
    channel: grpc.aio.Channel

    def gateway(self) -> Gateway:
        return Gateway(self.channel)

    def in_flight(self, engine: FakeEngine) -> int:
        replica = self.router.state.router.replica(engine.address)
        assert replica is not None
        return replica.in_flight


async def tls_channel(address: str) -> grpc.aio.Channel:
    """A channel that trusts the certificate the picker at ``address`` presents (as a gateway
    does without checking it, but here checked against what the handshake shows)."""
    host, port = address.rsplit(":", 1)
    pem = await asyncio.to_thread(ssl.get_server_certificate, (host, int(port)))
    credentials = grpc.ssl_channel_credentials(root_certificates=pem.encode())
    override = [("grpc.ssl_target_name_override", tls.COMMON_NAME)]
    return grpc.aio.secure_channel(address, credentials, options=override)


@contextlib.asynccontextmanager
async def picker_for(tiers: list[Any], **overrides: Any) -> AsyncIterator[Picker]:
    port = free_port()
    config = make_config(tiers, eppPort=port, **overrides)
    address = f"127.0.0.1:{port}"
    async with running_router(config) as router:
        channel = (
            await tls_channel(address) if config.epp_tls else grpc.aio.insecure_channel(address)
        )
        async with channel:
            yield Picker(router, channel)


@pytest_asyncio.fixture
async def two_engines() -> AsyncIterator[list[FakeEngine]]:
    async with engines(FakeEngine("a"), FakeEngine("b")) as started:
        yield started


@pytest_asyncio.fixture
async def picker(two_engines: list[FakeEngine]) -> AsyncIterator[Picker]:
    async with picker_for([tier("only", 1.0, two_engines)], debugRouteHeader=True) as running:
        yield running


async def test_a_chat_is_picked_sent_and_counted_until_its_answer_ends(
    picker: Picker, two_engines: list[FakeEngine]
) -> None:
    gateway = picker.gateway()
    picked = await gateway.request(CHAT)
    addresses = {e.address for e in two_engines}
    assert picked.endpoints[0] in addresses
    assert set(picked.endpoints) == addresses  # the other one is the fallback
    # The service's name chose the tier: the engine is asked for the tier's model.
    assert json.loads(picked.body)["model"] == "only-model"
    engine = next(e for e in two_engines if e.address == picked.endpoints[0])
    assert picker.in_flight(engine) == 1  # counted from the pick, as at the router hop
    status, answer = await gateway.relay(picked)
    assert status == 200
    assert json.loads(answer)["choices"][0]["message"]["content"] == f"from {engine.name}"
    await wait_for(lambda: picker.in_flight(engine) == 0)
    assert (
        picker.router.metric(
            "fleetpilot_router_requests_total", tier="only", replica=engine.address, status="200"
        )
        == 1
    )
    assert engine.requests[-1]["model"] == "only-model"


async def test_a_streamed_answer_passes_through_chunk_by_chunk(
    picker: Picker, two_engines: list[FakeEngine]
) -> None:
    gateway = picker.gateway()
    picked = await gateway.request({**CHAT, "stream": True})
    status, answer = await gateway.relay(picked)
    assert status == 200
    events = [line for line in answer.decode().split("\n") if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    assert len(events) > 2


async def test_complexity_picks_the_tier_and_rewrites_the_model() -> None:
    async with engines(FakeEngine("small"), FakeEngine("large")) as (small, large):
        tiers = [tier("small", 0.4, [small]), tier("large", 1.0, [large])]
        async with picker_for(tiers) as running:
            short = await running.gateway().request(SHORT, path="/v1/completions")
            assert short.endpoints == [small.address]
            hard = await running.gateway().request(HARD, path="/v1/completions")
            assert hard.endpoints == [large.address]
            assert json.loads(hard.body)["model"] == "large-model"


@pytest.mark.parametrize(
    ("body", "path", "headers", "status"),
    [
        (b"{not json", "/v1/chat/completions", {}, 400),
        (b"", "/v1/chat/completions", {}, 400),
        (CHAT, "/v1/embeddings", {}, 404),
        (CHAT, "/v1/chat/completions", {"content-type": "text/plain"}, 415),
        ({**CHAT, "model": "gpt-4"}, "/v1/chat/completions", {}, 404),
    ],
)
async def test_a_request_the_router_refuses_gets_an_immediate_openai_error(
    picker: Picker,
    two_engines: list[FakeEngine],
    body: Any,
    path: str,
    headers: dict[str, str],
    status: int,
) -> None:
    picked = await picker.gateway().request(body, path, headers)
    code, error = picked.error()
    assert code == status
    assert error["error"]["code"] == status
    assert error["error"]["message"]
    assert [picker.in_flight(e) for e in two_engines] == [0, 0]


async def test_a_body_over_the_limit_is_refused_before_it_all_arrives(
    two_engines: list[FakeEngine],
) -> None:
    async with picker_for([tier("only", 1.0, two_engines)], maxBodyBytes=64) as running:
        picked = await running.gateway().request({**CHAT, "padding": "x" * 200})
        assert picked.error()[0] == 413


async def test_the_gateways_subset_hint_is_honoured(
    picker: Picker, two_engines: list[FakeEngine]
) -> None:
    for engine in two_engines:
        picked = await picker.gateway().request(CHAT, subset=[engine.address])
        assert picked.endpoints == [engine.address]  # no fallback outside the subset
    picked = await picker.gateway().request(CHAT, subset=[])
    assert picked.error()[0] == 503
    picked = await picker.gateway().request(CHAT, subset=["10.9.9.9:8000"])
    assert picked.error()[0] == 503


async def test_a_fallback_that_served_takes_the_requests_count(
    picker: Picker, two_engines: list[FakeEngine]
) -> None:
    gateway = picker.gateway()
    picked = await gateway.request(CHAT)
    first, fallback = picked.endpoints
    by_address = {e.address: e for e in two_engines}
    status, _ = await gateway.relay(picked, served=fallback)
    assert status == 200
    assert by_address[fallback].requests
    assert not by_address[first].requests
    await wait_for(lambda: [picker.in_flight(e) for e in two_engines] == [0, 0])
    assert (
        picker.router.metric(
            "fleetpilot_router_requests_total", tier="only", replica=fallback, status="200"
        )
        == 1
    )


async def test_a_gateway_that_goes_away_mid_answer_gives_every_count_back(
    picker: Picker, two_engines: list[FakeEngine]
) -> None:
    gateway = picker.gateway()
    picked = await gateway.request(CHAT)
    engine = next(e for e in two_engines if e.address == picked.endpoints[0])
    assert picker.in_flight(engine) == 1
    gateway.call.cancel()
    await wait_for(lambda: picker.in_flight(engine) == 0)
    await wait_for(
        lambda: (
            picker.router.metric("fleetpilot_router_in_flight_requests") == 0
            and picker.router.metric("fleetpilot_router_unfinished_requests") == 0
        )
    )


async def test_tenant_keys_are_checked_and_kept_from_the_engines(
    two_engines: list[FakeEngine], tmp_path: Path
) -> None:
    keys = tmp_path / "team.keys"
    keys.write_text("sk-team-0123456789abcdef")
    auth = AuthConfig(tenants=[TenantKeys(name="team", key_files=[str(keys)])])
    async with picker_for([tier("only", 1.0, two_engines)], auth=auth) as running:
        refused = await running.gateway().request(CHAT)
        assert refused.error()[0] == 401
        gateway = running.gateway()
        picked = await gateway.request(
            CHAT, headers={"authorization": "Bearer sk-team-0123456789abcdef"}
        )
        mutation = picked.response.request_headers.response.header_mutation
        assert list(mutation.remove_headers) == ["authorization"]
        status, _ = await gateway.relay(picked)
        assert status == 200


async def test_a_bodiless_request_goes_to_a_ready_replica(
    picker: Picker, two_engines: list[FakeEngine]
) -> None:
    gateway = picker.gateway()
    await gateway.call.write(headers_message("/v1/models", {}, end_of_stream=True))
    answer = await gateway.call.read()
    endpoint = set_headers(answer)[protocol.DESTINATION_KEY]
    assert endpoint in {e.address for e in two_engines}
    # The stream stays open for the answer, which passes through as the engine wrote it (the
    # test's gateway POSTs, so the engine's /health says 405).
    status, body = await gateway.relay(Picked(answer, endpoints=[endpoint]), path="/health")
    assert status == 405
    assert b"Not Allowed" in body


async def test_the_picker_answers_grpc_health(picker: Picker) -> None:
    stub = health_pb2_grpc.HealthStub(picker.channel)
    for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("stream", [True, False])
async def test_a_reply_through_the_gateway_is_remembered_for_the_next_turn(stream: bool) -> None:
    """As at the router hop: the tier's tokenizer gets the reply the picker saw pass, so the
    conversation's next turn encodes only its new message."""
    name = "e" * 100
    engine = FakeEngine(name, chunks=20)
    async with engines(engine), picker_for([tokenizer_tier(engine)]) as running:
        state = running.router.state
        await wait_for(lambda: "small" in state.router.tokenizers, timeout_s=20)
        tokenizer = RecordingTokenizer()
        state.router.tokenizers["small"] = tokenizer
        state.router.affinity.kv_live = lambda _stream: True
        messages = [SYSTEM, {"role": "user", "content": "where is my order?"}]
        gateway = running.gateway()
        picked = await gateway.request({"model": "sm", "messages": messages, "stream": stream})
        status, _ = await gateway.relay(picked)
        assert status == 200
        await wait_for(lambda: tokenizer.replies)
        reply = "".join(f"{name}-{i} " for i in range(20)) if stream else f"from {name}"
        assert tokenizer.replies == [reply]


async def test_the_picker_says_the_prompts_blocks_by_tier_as_the_router_hop_does() -> None:
    """Issue 46: with the prompt in the engine's host memory only (its KV events say so), the
    picker's pick and the router hop's answer carry the same kv-blocks - all host, none
    computed - and both decisions are counted by tier."""
    engine = FakeEngine("e")
    async with engines(engine), picker_for([tokenizer_tier(engine)]) as running:
        state = running.router.state
        await wait_for(lambda: "small" in state.router.tokenizers, timeout_s=20)
        state.router.affinity.kv_live = lambda _stream: True
        messages = [SYSTEM, {"role": "user", "content": "where is my order?"}]
        tokens = RequestTokenizer.from_dir(REFERENCE_TOKENIZER).token_ids(
            "chat", {"messages": messages}
        )
        full = len(tokens) // 16
        hashes: list[BlockHash] = list(range(full))
        stored = BlockStored(hashes, None, tokens[: full * 16], 16, None, MEDIUM_CPU, None)
        state.kv_index.apply(engine.address, [stored])
        body = {"model": "sm", "messages": messages}
        gateway = running.gateway()
        picked = await gateway.request(body)
        picked_route = set_headers(picked.response)["x-fleetpilot-route"]
        assert f"kv-blocks=device:0,host:{full},computed:0" in picked_route
        status, _ = await gateway.relay(picked)
        assert status == 200
        # What the pick just sent there is on the engine's device by now, as far as the
        # router knows: forget it, so the router hop reads the same evidence.
        state.router.affinity.recent = RecentSends()
        async with (
            aiohttp.ClientSession() as session,
            session.post(running.router.url + "/v1/chat/completions", json=body) as resp,
        ):
            assert resp.status == 200
            hop_route = resp.headers["x-fleetpilot-route"]
        assert hop_route == picked_route
        counted = running.router.metric(
            "fleetpilot_router_predicted_kv_blocks_total", tier="small", source="host"
        )
        assert counted == 2 * full


async def test_the_picker_serves_over_tls_with_the_certificate_it_made(
    two_engines: list[FakeEngine],
) -> None:
    async with picker_for([tier("only", 1.0, two_engines)], eppTls=True) as running:
        picked = await running.gateway().request(CHAT)
        assert picked.endpoints[0] in {e.address for e in two_engines}
        # A gateway configured without TLS gets no answer from it.
        address = f"127.0.0.1:{running.router.state.router.config.epp_port}"
        async with grpc.aio.insecure_channel(address) as plain:
            stub = health_pb2_grpc.HealthStub(plain)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
