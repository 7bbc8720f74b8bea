"""The router as a Gateway API Inference Extension endpoint picker: Envoy's external-processing
gRPC service, answering a gateway's "where does this request go?" with the router's own
decision - the same admission (fair queue, tenant limits, cold-start hold), tiers, KV-event
prefix index, load and adapters as the router hop, on the same ``Proxy`` and ``Router``
objects, so a request through the gateway and one through the router hop count against each
other.

One gRPC stream is one HTTP request (``protocol`` has the message shapes):

1. request headers: the tenant's key and the Content-Type checked, the client's unfinished
   requests and the tenant's request rate admitted - as at the router hop, before the body;
2. request body (buffered to its end, at most ``maxBodyBytes``): parsed, decided, the picked
   replica (and a fallback) answered with the body the replica is to get - the tier's model
   named in it when complexity chose another tier;
3. response headers and body: passed through, watched to keep the replica's in-flight and
   pending-prefill counts true (the prompt computed at the first body chunk, the request
   over at the last) and to count the request by its status;
4. the stream's end, however it ends (the gateway gone, a reset): every count given back.

A refusal is an ``ImmediateResponse`` with the router's OpenAI-style JSON error, never a hung
stream. A disaggregated tier's request goes to its decode replica with the prefill replica in
``x-prefiller-host-port``, llm-d's convention for a decode-side sidecar that runs the prefill
hop (the gateway itself cannot make two upstream calls).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer

from fleetpilot.httpserver import content_type_refusal, is_json_content_type
from fleetpilot.listening import listening_on
from fleetpilot.routing.admission import Entry
from fleetpilot.routing.epp import protocol
from fleetpilot.routing.epp.tls import Identity
from fleetpilot.routing.errors import (
    BodyTooLargeError,
    InvalidRequestError,
    RouterError,
    UnavailableError,
    UnknownModelError,
    UpstreamTimeoutError,
)
from fleetpilot.routing.exchange import Exchange
from fleetpilot.routing.features import Kind
from fleetpilot.routing.proxy import PATHS, Proxy, new_request_id, upstream_body
from fleetpilot.routing.relay import (
    REQUEST_ID_HEADER,
    ROUTE_HEADER,
    STATUS_CLIENT_CLOSED,
    usage_tokens,
)
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.route import Route
from fleetpilot.routing.upstream import Attempt, json_bytes

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
KINDS: dict[str, Kind] = {path: kind for kind, path in PATHS.items()}
# Endpoints the gateway may try after the picked one (proposal 004's fallbacks), in order.
FALLBACKS = 1
# How much of a whole (non-streamed) answer is kept to read its usage (tenant token limits).
USAGE_BODY_BYTES = 1 << 20


class PickStream:
    """One request's ext_proc stream: its state from the request headers to the response's
    end. ``on`` answers each message; ``close`` gives back whatever the request still holds."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.router = proxy.router
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.exchange: Exchange | None = None
        self.client: str | None = None  # open in admission until close
        self.status = ""
        self.streamed = False  # the answer is an event stream
        self.answer = bytearray()  # a whole (non-streamed) answer, for its usage
        self.done = False  # an immediate response ended the exchange

    async def on(self, message: Any) -> list[Any]:
        phase = protocol.phase(message)
        try:
            if phase == "request_headers":
                return self._request_headers(message)
            if phase == "request_body":
                return await self._request_body(message)
            if phase == "response_headers":
                return self._response_headers(message)
            if phase == "response_body":
                return self._response_body(message)
            if phase in ("request_trailers", "response_trailers"):
                return [protocol.trailers(phase)]
        except RouterError as exc:
            return [self._refuse(exc)]
        return []

    # -- the request -------------------------------------------------------------------------
    def _request_headers(self, message: Any) -> list[Any]:
        self.headers = protocol.headers_of(message.request_headers)
        self.subset = protocol.subset_hint(message)
        tenant = self.proxy.authenticate(self.headers.get("authorization"))
        if message.request_headers.end_of_stream:
            # No body (a GET of /v1/models, a health check): any replica that can take it,
            # as GIE's picker does; nothing to decide or count.
            return [self._anywhere()]
        path = self.headers.get(":path", "").partition("?")[0]
        kind = KINDS.get(path)
        if kind is None:
            method = self.headers.get(":method", "POST")
            raise UnknownModelError(f"no route for {method} {path}", reason="not_found")
        content_type = self.headers.get("content-type")
        if not is_json_content_type(content_type):
            raise RouterError(
                content_type_refusal(content_type), status=415, reason="unsupported_media_type"
            )
        client = tenant.name if tenant is not None else self._client_address()
        self.proxy.admission.open_client(client)
        self.client = client
        exchange = Exchange(None, kind, self.proxy.metrics, tenant=tenant, entry=Entry(tenant))
        self.exchange = exchange
        exchange.admit_request(self.proxy.tenant_limits(exchange))
        return []  # the headers are answered with the pick, once the body is here

    def _client_address(self) -> str:
        forwarded = self.headers.get("x-forwarded-for", "")
        return forwarded.split(",")[0].strip()

    async def _request_body(self, message: Any) -> list[Any]:
        chunk = message.request_body
        self.body += chunk.body
        limit = self.router.config.max_body_bytes
        if len(self.body) > limit:
            raise BodyTooLargeError(
                f"the request body exceeds the limit of {limit} bytes", reason="request_too_large"
            )
        if not chunk.end_of_stream:
            return []
        exchange = self.exchange
        if exchange is None:  # a body without headers: not a gateway speaking the protocol
            raise InvalidRequestError("request body before its headers", reason="invalid_request")
        raw = bytes(self.body)
        self.body = bytearray()
        if not raw:
            raise InvalidRequestError(
                "the request body is empty; send a JSON object", reason="invalid_json"
            )
        self.proxy.admission.take_in_flight(exchange.entry)
        body, features = await self.proxy.parsed(exchange, raw, self.headers)
        timeout_s = self.router.config.request_timeout.total_seconds()
        try:
            async with asyncio.timeout(timeout_s):
                route = await self.proxy.decide(exchange, features)
        except TimeoutError:
            held = self.proxy.admission.hold_refusal(exchange.entry)
            raise held or UpstreamTimeoutError(
                "no replica could take the request within the router's request timeout",
                reason="timeout",
            ) from None
        replica = self._within_subset(route)
        fallbacks = self._fallbacks(route, replica)
        payload = self._payload(route, body, raw)
        exchange.replica = replica
        # The reply, for the tokenizer to hold the conversation's next turn (as at the hop).
        exchange.capture = self.proxy.reply_capture(exchange.kind, route, body, len(raw))
        exchange.attempt = Attempt(replica, route.sent_prefill_blocks).begin()
        request_id = self.headers.get(REQUEST_ID_HEADER.lower())
        set_headers = {
            "content-length": str(len(payload)),
            ROUTE_HEADER.lower(): self.proxy.relay.route_header(route, replica),
        }
        if request_id is None:
            set_headers[REQUEST_ID_HEADER.lower()] = exchange.request_id = new_request_id()
        if route.disaggregated and not route.local_prefill and route.prefill is not None:
            set_headers[protocol.PREFILL_HEADER] = route.prefill.id
        # The tenant's key is the router's to check, not the engines' to see.
        removed = ["authorization"] if exchange.tenant is not None else []
        endpoints = [replica.id, *(r.id for r in fallbacks)]
        return [protocol.picked(endpoints, set_headers, removed), *protocol.request_body(payload)]

    def _within_subset(self, route: Route) -> ReplicaState:
        """The route's replica, or - when the gateway's subset hint leaves it out - the
        router's next pick among the hint's replicas; 503 when none of them can serve."""
        replica = route.replica
        subset = self.subset
        if subset is None or replica.id in subset:
            return replica
        outside = {r.id for r in self.router.replicas() if r.id not in subset}
        # (The decision recorded a send to the replica left out; the guessed index keeps it
        # until it ages out: subset hints are rare, a multi-cluster gateway's.)
        other = self.router.alternative(route, outside | {replica.id})
        if other is None:
            raise UnavailableError(
                f"none of the gateway's {len(subset)} candidate endpoints can serve tier "
                f"{route.tier.name}",
                reason="no_replica_in_subset",
            )
        return other

    def _fallbacks(self, route: Route, picked: ReplicaState) -> list[ReplicaState]:
        """Replicas the gateway may retry on, after the picked one (none for a P/D tier: its
        prefill replica is tied to the decode pick)."""
        if route.disaggregated:
            return []
        tried = {picked.id}
        if self.subset is not None:
            tried |= {r.id for r in self.router.replicas() if r.id not in self.subset}
        out: list[ReplicaState] = []
        for _ in range(FALLBACKS):
            chosen = self.router.fallback(route, tried)
            if chosen is None:
                break
            out.append(chosen)
            tried.add(chosen.id)
        return out

    def _payload(self, route: Route, body: dict[str, Any], raw: bytes) -> bytes:
        if route.local_prefill:
            self.proxy.metrics.pd_local_prefills.labels(route.tier.name).inc()
        try:
            return upstream_body(route, body, raw)
        except RecursionError:
            raise InvalidRequestError(
                "the request body is nested too deeply", reason="invalid_json"
            ) from None

    def _anywhere(self) -> Any:
        replicas = [r for r in self.router.replicas() if not self.router.health.is_ejected(r.id)]
        if self.subset is not None:
            replicas = [r for r in replicas if r.id in self.subset]
        if not replicas:
            raise UnavailableError("no replica is ready", reason="no_ready_replicas")
        least = min(replicas, key=lambda r: r.in_flight + r.peer_in_flight)
        # The stream stays open: the gateway sends the answer's phases through it too.
        return protocol.picked([least.id], {})

    # -- the response ------------------------------------------------------------------------
    def _response_headers(self, message: Any) -> list[Any]:
        headers = protocol.headers_of(message.response_headers)
        self.status = headers.get(":status", "200")
        self.streamed = headers.get("content-type", "").startswith("text/event-stream")
        exchange = self.exchange
        if exchange is None or exchange.route is None:
            return [protocol.response_headers()]
        served = protocol.served_endpoint(message)
        replica = exchange.replica
        if served is not None and replica is not None and served != replica.id:
            self._moved_to(exchange, served)
        replica = exchange.replica
        assert replica is not None
        if self.status.startswith("5"):
            self.router.record_failure(replica)
        else:
            self.router.record_success(replica)
        if message.response_headers.end_of_stream:
            self._finish(exchange)
        route_header = self.proxy.relay.route_header(exchange.route, replica)
        return [protocol.response_headers({ROUTE_HEADER.lower(): route_header})]

    def _moved_to(self, exchange: Exchange, served: str) -> None:
        """The gateway retried on a fallback: the request's counts move there."""
        replica = self.router.replica(served)
        if replica is None:
            log.info("served by an endpoint the router does not list", extra={"endpoint": served})
            return
        if exchange.attempt is not None:
            exchange.attempt.end()
        route = exchange.routed
        self.proxy.metrics.retries.labels(route.tier.name).inc()  # the gateway's retry
        exchange.replica = replica
        exchange.attempt = Attempt(replica, route.sent_prefill_blocks).begin()

    def _response_body(self, message: Any) -> list[Any]:
        chunk = message.response_body
        exchange = self.exchange
        if exchange is not None and exchange.route is not None:
            self._watch(exchange, chunk.body)
            if chunk.end_of_stream:
                self._finish(exchange)
        return protocol.response_body(chunk.body, chunk.end_of_stream)

    def _watch(self, exchange: Exchange, data: bytes) -> None:
        """A piece of the answer on its way, noted as the router hop notes it (the first
        marks the prompt computed, the reply captured, the usage read); a whole answer's
        pieces are kept too, as its usage may straddle two of them."""
        if not data:
            return
        self.proxy.relay.note_chunk(exchange, data)
        if (
            not self.streamed
            and exchange.limits is not None
            and len(self.answer) + len(data) <= USAGE_BODY_BYTES
        ):
            self.answer += data

    def _finish(self, exchange: Exchange) -> None:
        """The answer is complete: counted by its status, the replica's counts given back,
        the tenant's reserve settled with what the answer says it used."""
        if exchange.attempt is not None:
            exchange.attempt.end()
        exchange.count(self.status or "200")
        if self.status != "200":
            return
        exchange.answered = True
        if not self.streamed and exchange.limits is not None:
            exchange.used = usage_tokens(bytes(self.answer))
        if exchange.capture is not None:
            self.proxy.relay.remember(exchange.capture, streamed=self.streamed)

    # -- the end -----------------------------------------------------------------------------
    def _refuse(self, error: RouterError) -> Any:
        self.done = True
        self.proxy.metrics.rejected.labels(str(error.status), error.reason or "").inc()
        headers = {k.lower(): v for k, v in error.response_headers().items()}
        return protocol.immediate(error.status, json_bytes(error.body()), headers)

    def close(self) -> None:
        """Whatever the request still holds, given back (idempotent)."""
        exchange = self.exchange
        if exchange is not None:
            if exchange.attempt is not None:
                exchange.attempt.end()
            exchange.count(STATUS_CLIENT_CLOSED)  # a no-op once counted
            if exchange.capture is not None:
                exchange.capture.drop()  # not handed to the tokenizer: its budget back
            self.proxy.admission.finish(exchange.entry)
            exchange.settle()
            self.exchange = None
        if self.client is not None:
            self.proxy.admission.close_client(self.client)
            self.client = None


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``envoy.service.ext_proc.v3.ExternalProcessor``: one ``PickStream`` a stream."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    async def Process(  # noqa: N802 - the gRPC method's name
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        stream = PickStream(self.proxy)
        try:
            async for message in requests:
                for response in await stream.on(message):
                    yield response
                if stream.done:
                    return
        finally:
            stream.close()


async def start_picker(
    proxy: Proxy, host: str, port: int, *, identity: Identity | None = None
) -> grpc.aio.Server:
    """A started gRPC server on ``host:port`` with the picker and the standard health
    service (SERVING for the ext_proc service and overall); over TLS with ``identity``."""
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(proxy), server)
    health = HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for service in ("", EXT_PROC_SERVICE):
        health.set(service, health_pb2.HealthCheckResponse.SERVING)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with listening_on(host, port):
        try:
            if identity is None:
                bound = server.add_insecure_port(address)
            else:
                pair = (identity.key_pem, identity.certificate_pem)
                bound = server.add_secure_port(address, grpc.ssl_server_credentials([pair]))
        except RuntimeError as exc:  # grpc's word for a failed bind
            raise OSError(str(exc)) from exc
        if bound == 0:
            raise OSError(f"cannot listen on {address}")
    await server.start()
    return server
