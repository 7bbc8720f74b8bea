"""The HTTP work of one request: read and check it, ask the router where it goes, send it
(two hops for a disaggregated tier), retry before the first byte, and relay the answer -
streamed chunk by chunk as it arrives, never buffered.

The entry and the retry loop live here; each other concern has a module of its own, wired by
:class:`Proxy`: ``admission`` (client and in-flight counts, the fair queue, the cold-start
hold), ``exchange`` (one request's state as it travels), ``upstream`` (attempts on replicas:
their counters, the first-byte watch, the records, the P/D prefill hop) and ``relay`` (the
answer back, streamed and resumed).

Upstream client: one pooled ``aiohttp.ClientSession``. ``bench/router_client.py`` measured it
against ``httpx.AsyncClient`` on the same echo backend; aiohttp had the lower per-request cost
(numbers in ``bench/results/router_client.json``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web

from fleetpilot.httpserver import content_type_refusal, is_json_content_type
from fleetpilot.routing.admission import Admission, Entry
from fleetpilot.routing.auth import AuthGate, Tenant
from fleetpilot.routing.errors import (
    BodyTooLargeError,
    InvalidRequestError,
    RouterError,
    UpstreamFailedError,
    UpstreamTimeoutError,
)
from fleetpilot.routing.exchange import Exchange, Resumable
from fleetpilot.routing.features import Kind, RequestFeatures, extract_features
from fleetpilot.routing.limits import TenantLimits
from fleetpilot.routing.metrics import RouterMetrics
from fleetpilot.routing.policies.pd import KV_TRANSFER_PARAMS, client_body, decode_request
from fleetpilot.routing.relay import (
    REQUEST_ID_HEADER,
    ROUTE_HEADER,
    STATUS_CLIENT_CLOSED,
    Relay,
    stream_error,
    usage_tokens,
)
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.replies import REPLY_CAPTURE_TOTAL_BYTES, CaptureBudget, ReplyCapture
from fleetpilot.routing.resume import resumable_body
from fleetpilot.routing.route import Resolved, Route
from fleetpilot.routing.router import Router
from fleetpilot.routing.upstream import (
    FIRST_BYTE_TIMEOUT,
    SUSPECT,
    Answer,
    Attempt,
    Upstream,
    json_bytes,
)

__all__ = ["ROUTE_HEADER", "Proxy", "error_response", "usage_tokens"]

log = logging.getLogger(__name__)

PATHS: dict[Kind, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Client headers an engine may need; everything else (cookies, hop-by-hop headers, Host) stays
# here. Authorization is forwarded for engines started with --api-key, and never logged.
FORWARDED_HEADERS = ("Authorization", "Accept", "traceparent", "tracestate")
# Threads computing the KV-index keys of long prompts off the event loop (router.PreparedKeys):
# the encode itself releases the GIL, the template render and key chaining hold it, so more
# workers than the two a router pod's CPU gives would queue on the GIL; two let a second long
# prompt start while one encodes.
TOKENIZE_WORKERS = 2
# A request body over this many bytes is parsed and its complexity features read in those
# threads too: the features' marker regexes cost ~0.4 us a character of the last 32k
# (features.MARKER_SCAN_CHARS), ~13 ms for a long prompt, so 4 KiB stalls the loop ~1.5 ms
# at most, about what OFF_LOOP_TOKENIZE_CHARS allows the tokenizer.
PARSE_OFF_LOOP_BYTES = 4096


def error_response(error: RouterError) -> web.Response:
    return web.Response(
        status=error.status,
        body=json_bytes(error.body()),
        content_type="application/json",
        headers=error.response_headers(),
    )


class Proxy:
    """Handles ``/v1/completions`` and ``/v1/chat/completions``."""

    def __init__(
        self,
        router: Router,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        *,
        debug_route_header: bool = False,
        auth: AuthGate | None = None,
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.session = session
        # API keys (routing.auth): None or a gate without a ring admits every request.
        self.auth = auth
        self.admission: Admission[Route] = Admission(router, metrics, self._route)
        self.upstream = Upstream(router, metrics, session)
        self.relay = Relay(router, metrics, self.upstream, debug_route_header=debug_route_header)
        self._tokenize_pool = ThreadPoolExecutor(
            TOKENIZE_WORKERS, thread_name_prefix="fleetpilot-tokenize"
        )
        self._capture_budget = CaptureBudget(REPLY_CAPTURE_TOTAL_BYTES)

    def close(self) -> None:
        """Stop the worker threads (a prompt being tokenized finishes; queued work is dropped)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.relay.close()
        self.upstream.close()

    # -- entry -------------------------------------------------------------------------------
    async def handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        """Admission from the headers alone (key, Content-Type, the client's unfinished
        requests, the tenant's request rate), then the body; only a request whose body has
        arrived counts against ``maxInFlight``, so clients sending bodies slowly - each cut by
        the listener's body rule (``httpserver.body_verdict``) - cannot fill it (issue 41)."""
        try:
            tenant = self.authenticate(request.headers.get("Authorization"))
        except RouterError as exc:
            return self._reject(exc)
        content_type = request.headers.get("Content-Type")
        if not is_json_content_type(content_type):
            return self._reject(
                RouterError(
                    content_type_refusal(content_type),
                    status=415,
                    reason="unsupported_media_type",
                )
            )
        client = tenant.name if tenant is not None else (request.remote or "")
        try:
            self.admission.open_client(client)
        except RouterError as exc:
            return self._reject(exc)
        try:
            exchange = Exchange(request, kind, self.metrics, tenant=tenant, entry=Entry(tenant))
            return await self._admitted(exchange)
        finally:
            self.admission.close_client(client)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant whose API key the request carries (None without ``routing.auth``), or
        the RouterError to refuse it with. Before any routing work, the body not even read: a
        request without a valid key costs a digest and a header."""
        ring = self.auth.ring if self.auth is not None else None
        if ring is None:
            return None
        tenant = ring.authenticate(authorization)
        self.metrics.tenant_requests.labels(tenant.name).inc()
        return tenant

    async def _admitted(self, exchange: Exchange) -> web.StreamResponse:
        timeout_s = self.router.config.request_timeout.total_seconds()
        try:
            async with asyncio.timeout(timeout_s):
                return await self._handle(exchange)
        except RouterError as exc:
            if exchange.response is not None:
                return exchange.response
            if exchange.route is not None:
                # Routed, then failed upstream: say where it went.
                header = self.relay.route_header(exchange.route, exchange.replica)
                exc.headers = {**exc.headers, ROUTE_HEADER: header}
            return self._reject(exc)
        except asyncio.CancelledError:
            # The client left (handler cancellation) before its answer was complete: count it
            # as proxies do, whichever await it left in (a non-streamed request spends its
            # whole wait inside the upstream call, before any relaying).
            exchange.count(STATUS_CLIENT_CLOSED)
            raise
        except TimeoutError:
            return await self._timed_out(exchange)
        finally:
            self.admission.finish(exchange.entry)
            exchange.settle()

    async def _timed_out(self, exchange: Exchange) -> web.StreamResponse:
        """The answer to a request its own timeout ended."""
        held = self.admission.hold_refusal(exchange.entry)
        if held is not None:
            # Held for a tier at zero until the request's own timeout: the hold ran out.
            return self._reject(held)
        if (
            exchange.replica is not None
            and exchange.route is not None
            and exchange.response is None
        ):
            # A replica that gave no byte within the whole timeout is hung or hopelessly
            # behind: it counts towards ejection like a refused connection.
            self.upstream.failed(exchange.route, exchange.replica, "timeout")
        if exchange.response is not None:
            # Mid-stream: the status is sent; end the stream with an error event.
            await stream_error(exchange.response, 504, "request timeout exceeded")
            exchange.count("504")
            return exchange.response
        exchange.count("504")
        return error_response(
            UpstreamTimeoutError(
                "the request exceeded the router's request timeout", reason="timeout"
            )
        )

    def _reject(self, error: RouterError) -> web.Response:
        self.metrics.rejected.labels(str(error.status), error.reason or "").inc()
        return error_response(error)

    # -- one request -------------------------------------------------------------------------
    async def _handle(self, exchange: Exchange) -> web.StreamResponse:
        # The request itself is taken from the tenant's bucket now, from the headers: a key at
        # its request limit gets 429 before it may send (or trickle) a body; its tokens once
        # parsed.
        exchange.admit_request(self.tenant_limits(exchange))
        raw = await _read_body(exchange.http, self.router.config.max_body_bytes)
        self.admission.take_in_flight(exchange.entry)
        body, features = await self.parsed(exchange, raw, exchange.http.headers)
        await self.decide(exchange, features)
        await self._prepare(exchange, body, raw, features)
        try:
            return await self._send(exchange)
        finally:
            if exchange.capture is not None:
                exchange.capture.drop()  # not handed to the tokenizer: its budget back

    async def parsed(
        self, exchange: Exchange, raw: bytes, headers: Mapping[str, str]
    ) -> tuple[Any, RequestFeatures]:
        """The body and its features (parsed off the loop when long), within the tenant's
        reach, its tokens taken from the tenant's bucket."""
        if len(raw) > PARSE_OFF_LOOP_BYTES:
            loop = asyncio.get_running_loop()
            body, features = await loop.run_in_executor(
                self._tokenize_pool, _parse, raw, exchange.kind, headers
            )
        else:
            body, features = _parse(raw, exchange.kind, headers)
        exchange.stream = features.stream
        if exchange.tenant is not None:
            tenant = exchange.tenant
            features = replace(
                features,
                allowed_tiers=tenant.allowed_tiers,
                allowed_adapters=tenant.allowed_adapters,
            )
            exchange.admit_tokens(features)
        return body, features

    def tenant_limits(self, exchange: Exchange) -> TenantLimits | None:
        if exchange.tenant is None or self.auth is None:
            return None
        return self.auth.limiter.of(exchange.tenant.name)

    async def decide(self, exchange: Exchange, features: RequestFeatures) -> Route:
        """The routing decision for a parsed request, through admission (client and in-flight
        counts, the fair queue, the cold-start hold), counted in the metrics; the router hop
        and the endpoint picker (``routing.epp``) both decide here."""
        decided = time.perf_counter()
        route = await self.admission.decide(self.router.resolve(features), exchange.entry)
        self.metrics.decision_seconds.observe(time.perf_counter() - decided)
        exchange.route = route
        tier = route.tier
        self.metrics.count_decision(
            tier.name, route.reason, route.prefix_match, route.prefix_source, route.kv_blocks
        )
        if route.tokenizer_failed:
            self.metrics.tokenizer_errors.labels(tier.name).inc()
        if route.spilled_from is not None:
            self.metrics.spillovers.labels(route.spilled_from, tier.name).inc()
        return route

    async def _route(self, resolved: Resolved) -> Route:
        """The router's decision. A prompt whose tokenizing would stall the loop (a long cold
        one) has its KV-index keys computed in a worker thread first, while the loop relays
        other streams; a cheap one (a conversation's next turn) inline, as a thread hop would
        cost more than it moves."""
        prepared = self.router.prepare_keys(resolved)
        if prepared is not None and prepared.off_loop:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._tokenize_pool, prepared.compute)
        return self.router.decide(resolved, prepared)

    async def _prepare(
        self, exchange: Exchange, body: dict[str, Any], raw: bytes, features: RequestFeatures
    ) -> None:
        """What the replicas are sent: headers, path, payload (after the prefill hop of a
        disaggregated tier), and what the answer feeds (reply capture, stream resumes)."""
        route = exchange.routed
        headers = _upstream_headers(exchange.http)
        if exchange.tenant is not None:
            # The tenant's key is the router's to check, not the engines' to see.
            headers.pop("Authorization", None)
        exchange.headers = headers
        exchange.request_id = headers[REQUEST_ID_HEADER]
        exchange.path = PATHS[exchange.kind]
        exchange.payload = await self._payload(exchange, body, raw)
        exchange.capture = self.reply_capture(exchange.kind, route, body, len(raw))
        config = self.router.config
        if features.stream and config.stream_resumes > 0 and resumable_body(exchange.kind, body):
            exchange.resumable = Resumable(
                exchange.kind,
                client_body(body, route.served_model),
                exchange.path,
                headers,
                config.stream_resumes,
            )

    async def _payload(self, exchange: Exchange, body: dict[str, Any], raw: bytes) -> bytes:
        route = exchange.routed
        tier = route.tier.name
        try:
            if route.local_prefill:  # the decode replica holds the prompt: no hop
                self.metrics.pd_local_prefills.labels(tier).inc()
            elif route.disaggregated:
                params, cause = await self.upstream.prefill_hop(
                    route, body, exchange.path, exchange.headers
                )
                if params is not None:
                    exchange.prefill_id = route.prefill.id if route.prefill else None
                    return json_bytes(decode_request(body, route.served_model, params))
                self.metrics.pd_fallbacks.labels(tier, cause).inc()
            return upstream_body(route, body, raw)
        except RecursionError:
            raise InvalidRequestError(
                "the request body is nested too deeply", reason="invalid_json"
            ) from None

    def reply_capture(
        self, kind: Kind, route: Route, body: Mapping[str, Any], body_bytes: int
    ) -> ReplyCapture | None:
        """A capture of the reply for the tier's tokenizer, where the next turn can use it: a
        chat with one choice whose keys this decision computed (the tokenizer holds its
        prefix), within the capture budget."""
        tokenizer = self.router.tokenizers.get(route.tier.name)
        if (
            kind != "chat"
            or tokenizer is None
            or route.prefix_source != "events"
            or route.tokenizer_failed
            or body.get("n") not in (None, 1)
            or not self._capture_budget.take(body_bytes)
        ):
            return None
        return ReplyCapture(tokenizer, body, self._capture_budget, body_bytes)

    # -- the retry loop ----------------------------------------------------------------------
    async def _send(self, exchange: Exchange) -> web.StreamResponse:
        """Send to the route's replica; on a connect error, a disconnect before the answer, a
        5xx, or a 404 saying the replica lacks the request's LoRA adapter, try another replica
        of the same group, up to ``retries`` more times."""
        route = exchange.routed
        replica = route.replica
        tried = {replica.id}
        retries_left = self.router.config.retries
        now = self.router.clock
        blocks = route.sent_prefill_blocks

        def give_up() -> bool:
            # A suspect replica's wait goes to a sound one, while a retry is left for it.
            return (
                retries_left > 0
                and attempt.replica.suspect(now())
                and self.router.has_sound_peer(route, tried)
            )

        while True:
            exchange.replica = replica
            with Attempt(replica, blocks) as attempt:
                exchange.attempt = attempt
                answer = await self.upstream.post(
                    route, replica, exchange.path, exchange.payload, exchange.headers, give_up
                )
                if answer.cause is not None:
                    alternative = self._alternative(route, replica, tried, answer, retries_left)
                    if alternative is not None:
                        if answer.response is not None:
                            answer.response.close()
                        retries_left -= 1
                        tried.add(alternative.id)
                        replica = alternative
                        continue
                    if answer.response is None:
                        raise self._unanswered(exchange, answer) from answer.error
                assert answer.response is not None
                return await self.relay.relay(exchange, replica, answer.response)

    def _alternative(
        self,
        route: Route,
        replica: ReplicaState,
        tried: set[str],
        answer: Answer,
        retries_left: int,
    ) -> ReplicaState | None:
        """Where a failed attempt is retried, if anywhere (counted as a retry)."""
        if retries_left <= 0:
            return None
        alternative = self.router.alternative(route, tried)
        if alternative is None and answer.cause == "disconnect":
            # Dropped before any answer and no other replica: most likely a pooled keep-alive
            # connection the replica had closed (a restart). A fresh connection to the same
            # replica is worth one try.
            alternative = replica
        if alternative is not None:
            log.info(
                "retrying",
                extra={
                    "tier": route.tier.name,
                    "from": replica.id,
                    "to": alternative.id,
                    "cause": answer.cause,
                },
            )
            self.metrics.retries.labels(route.tier.name).inc()
        return alternative

    def _unanswered(self, exchange: Exchange, answer: Answer) -> RouterError:
        """The error (counted) for a request no replica answered, and no retry is left."""
        tier = exchange.routed.tier
        if answer.cause in ("timeout", FIRST_BYTE_TIMEOUT, SUSPECT):
            exchange.count("504")
            budget_s = self.router.first_byte_timeout_s(tier)
            return UpstreamTimeoutError(
                f"no replica of tier {tier.name} answered in time "
                f"({answer.cause}; first-byte budget {budget_s:g}s)",
                reason="upstream_timeout",
            )
        exchange.count("502")
        return UpstreamFailedError(
            f"no replica of tier {tier.name} could be reached ({answer.cause})",
            reason="upstream_unreachable",
        )


def upstream_body(route: Route, body: dict[str, Any], raw: bytes) -> bytes:
    """The body a unified (or locally prefilling) replica is sent: the client's bytes
    untouched when they already name the served model (the common pinned case), else the
    body with the tier's model or adapter and no client-set KV transfer parameters."""
    if body.get("model") == route.served_model and KV_TRANSFER_PARAMS not in body:
        return raw
    return json_bytes(client_body(body, route.served_model))


def _parse(raw: bytes, kind: Kind, headers: Mapping[str, str]) -> tuple[Any, RequestFeatures]:
    """The JSON body and its routing features (on any thread)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(
            f"the request body is not valid JSON: {exc}", reason="invalid_json"
        ) from None
    return body, extract_features(body, kind, headers)


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body, refusing (413) anything over ``limit`` bytes before reading it all."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLargeError(
            f"the request body is {request.content_length} bytes; the limit is {limit}",
            reason="request_too_large",
        )
    if request.content_length is not None:
        body = await request.read()  # length known and within the limit: one read
        if not body:
            raise InvalidRequestError(
                "the request body is empty; send a JSON object", reason="invalid_json"
            )
        return body
    chunks = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(
                f"the request body exceeds the limit of {limit} bytes", reason="request_too_large"
            )
        chunks.append(chunk)
    if not chunks:
        raise InvalidRequestError(
            "the request body is empty; send a JSON object", reason="invalid_json"
        )
    return b"".join(chunks)


# Request ids: a random per-process prefix and a counter; unique across router replicas and
# restarts, and cheaper than a uuid4 (a getrandom syscall) per request.
_ID_PREFIX = uuid.uuid4().hex[:12]
_id_counter = itertools.count(1)


def new_request_id() -> str:
    return f"{_ID_PREFIX}-{next(_id_counter):x}"


def _upstream_headers(request: web.Request) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    for name in FORWARDED_HEADERS:
        value = request.headers.get(name)
        if value is not None:
            headers[name] = value
    # One id across both P/D hops and the logs of every replica the request touches.
    headers[REQUEST_ID_HEADER] = request.headers.get(REQUEST_ID_HEADER) or new_request_id()
    return headers
