"""The answer's way back: relay an upstream response to the client, status and all - a whole
answer at once, a streamed one chunk by chunk as it arrives, never buffered - and continue a
stream whose replica died on another replica of its group, in the same client stream
(``routing.resume``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from fleetpilot.openai_errors import error_body, normalize_error
from fleetpilot.routing.exchange import Exchange, Resumable
from fleetpilot.routing.liveness import LivenessWatch, SilentReplicaError
from fleetpilot.routing.metrics import RouterMetrics
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.replies import ReplyCapture
from fleetpilot.routing.resume import (
    Rewriter,
    Sent,
    StreamLedger,
    closing,
    continuation,
    read_sent,
    tokenize_request,
)
from fleetpilot.routing.route import Route
from fleetpilot.routing.router import Router
from fleetpilot.routing.upstream import Attempt, Upstream, cause_of, json_bytes

log = logging.getLogger(__name__)

ROUTE_HEADER = "x-fleetpilot-route"
REQUEST_ID_HEADER = "X-Request-Id"
# Upstream answer headers worth relaying; lengths and encodings are the server's own business.
RELAYED_HEADERS = ("Content-Type", "Cache-Control")
STATUS_CLIENT_CLOSED = "499"  # nginx's code for "client closed the request"
# What ``_pump`` returns when the client left mid-stream.
_CLIENT_LEFT = "client-left"


@dataclass
class _Leg:
    """The part of a streamed answer one replica sends."""

    replica: ReplicaState
    response: aiohttp.ClientResponse
    # A continuation's own attempt (the first leg's is the retry loop's), and the rewriter
    # that makes its events read as the first leg's.
    attempt: Attempt | None = None
    rewriter: Rewriter | None = None

    def end(self) -> None:
        if self.attempt is not None:
            self.response.close()
            self.attempt.end()


class Relay:
    """Relays answers for the proxy."""

    def __init__(
        self,
        router: Router,
        metrics: RouterMetrics,
        upstream: Upstream,
        *,
        debug_route_header: bool = False,
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.upstream = upstream
        self.debug_route_header = debug_route_header
        self._remember_pool = ThreadPoolExecutor(1, thread_name_prefix="fleetpilot-remember")

    def close(self) -> None:
        self._remember_pool.shutdown(wait=False, cancel_futures=True)

    def remember(self, capture: ReplyCapture, *, streamed: bool) -> None:
        """A successful answer's captured reply, handed to its tier's tokenizer off the loop
        (the endpoint picker's answers too: one worker for both)."""
        capture.remember(self._remember_pool, streamed=streamed)

    def route_header(
        self, route: Route, replica: ReplicaState | None = None, prefill: str | None = None
    ) -> str:
        addresses = self.debug_route_header or self.router.config.debug_route_header
        return route.header(replica, prefill, addresses=addresses)

    async def relay(
        self, exchange: Exchange, replica: ReplicaState, response: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """Pass the upstream answer through, status and all (a successful chat reply also to
        the exchange's capture)."""
        out_headers = {h: v for h in RELAYED_HEADERS if (v := response.headers.get(h))}
        out_headers[ROUTE_HEADER] = self.route_header(exchange.routed, replica, exchange.prefill_id)
        out_headers[REQUEST_ID_HEADER] = exchange.request_id
        out_headers.update(exchange.rate_headers)
        exchange.answered = response.status < 400
        content_type = response.headers.get("Content-Type", "")
        done = False
        try:
            if not (exchange.stream and content_type.startswith("text/event-stream")):
                data = await response.read()
                done = True
                return self._whole(exchange, response.status, data, out_headers)
            out = web.StreamResponse(status=response.status, headers=out_headers)
            out.enable_chunked_encoding()
            await out.prepare(exchange.http)
            exchange.response = out
            if not await self._relay_stream(out, exchange, replica, response):
                return out  # counted: the stream broke, or the client left
            done = True
            exchange.count(str(response.status))  # the client has every byte of the answer now
            if exchange.capture is not None and response.status == 200:
                self.remember(exchange.capture, streamed=True)
            try:
                await out.write_eof()
            except ConnectionError:
                # The client read [DONE] and left before the chunked terminator: nothing of
                # the answer was lost.
                log.debug("client left before the end of the stream")
            return out
        except asyncio.CancelledError:
            # Client disconnect with handler cancellation, or the request timeout.
            if exchange.response is None or not done:
                exchange.count(STATUS_CLIENT_CLOSED)
            raise
        finally:
            if done:
                response.release()
            else:
                response.close()

    def _whole(
        self, exchange: Exchange, status: int, data: bytes, out_headers: dict[str, str]
    ) -> web.Response:
        if status >= 400:
            # An engine error is relayed in the router's own (vLLM's) shape, whatever shape
            # the engine wrote it in.
            fixed = normalize_error(status, data)
            if fixed is not None:
                data = fixed
                out_headers["Content-Type"] = "application/json"
        exchange.count(str(status))
        if exchange.limits is not None and exchange.answered:
            exchange.used = usage_tokens(data)
        if exchange.capture is not None and status == 200:
            exchange.capture.feed(data)
            self.remember(exchange.capture, streamed=False)
        return web.Response(status=status, body=data, headers=out_headers)

    # -- a stream ----------------------------------------------------------------------------
    async def _relay_stream(
        self,
        out: web.StreamResponse,
        exchange: Exchange,
        replica: ReplicaState,
        response: aiohttp.ClientResponse,
    ) -> bool:
        """Relay a streamed answer as it comes. When its replica dies (the connection breaks,
        or it goes silent and fails a liveness probe: ``liveness.LivenessWatch``) and the
        request can be resumed, the answer continues on another replica (``_resume``) in the
        same client stream. True when the client has the whole answer; otherwise it was told
        (an error event) or it left, and the request is counted."""
        route = exchange.routed
        resumable = exchange.resumable if response.status == 200 else None
        ledger = StreamLedger() if resumable is not None else None
        leg = _Leg(replica, response)
        tried = {replica.id}
        try:
            while True:
                cause = await self._pump(out, exchange, leg, ledger)
                if cause == _CLIENT_LEFT:
                    # Closing the upstream response (here or in the caller) cancels the
                    # generation on the engine.
                    exchange.count(STATUS_CLIENT_CLOSED)
                    return False
                if cause is None and (ledger is None or ledger.done):
                    if ledger is not None and (rest := ledger.rest()):
                        with contextlib.suppress(ConnectionError):
                            await out.write(rest)
                    return True
                # Broken, frozen, or ended without [DONE] (an engine shutting down).
                self.upstream.failed(route, leg.replica, cause or "stream")
                leg.response.close()
                resumed = None
                if resumable is not None and ledger is not None:
                    resumed = await self._resume(route, leg.replica, resumable, ledger, tried)
                if isinstance(resumed, bytes):  # the answer was whole: only its end was lost
                    with contextlib.suppress(ConnectionError):
                        await out.write(resumed)
                    return True
                if resumed is None:
                    await stream_error(out, 502, "the upstream replica stopped mid-stream")
                    exchange.count("502")
                    return False
                leg.end()
                leg = resumed
                exchange.replica = leg.replica
        finally:
            leg.end()

    async def _pump(
        self,
        out: web.StreamResponse,
        exchange: Exchange,
        leg: _Leg,
        ledger: StreamLedger | None,
    ) -> str | None:
        """Relay ``leg``'s chunks until it ends (None), breaks or stalls (the cause), or the
        client leaves (``_CLIENT_LEFT``)."""
        budget_s = self.router.first_byte_timeout_s(exchange.routed.tier)
        try:
            async with LivenessWatch(self.upstream.probe(leg.replica), budget_s) as watch:
                while True:
                    chunk = await leg.response.content.readany()
                    watch.progress()
                    if not chunk:
                        return None
                    relayed = self._chunk(exchange, leg, ledger, chunk)
                    if relayed is None:
                        continue
                    try:
                        await out.write(relayed)
                    except ConnectionError:
                        return _CLIENT_LEFT
        except SilentReplicaError:
            return "stall"
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning(
                "upstream stream broke",
                extra={"replica": leg.replica.id, "err": type(exc).__name__},
            )
            return "stream"

    def _chunk(
        self, exchange: Exchange, leg: _Leg, ledger: StreamLedger | None, chunk: bytes
    ) -> bytes | None:
        """What of ``chunk`` goes to the client now (None: nothing yet, an event is cut), the
        answer's bookkeeping done: the ledger, the capture, the usage, the first chunk."""
        if ledger is not None:
            chunk = ledger.whole(chunk)
            if not chunk:
                return None
            if leg.rewriter is not None:
                chunk = leg.rewriter.events(chunk)
            ledger.record(chunk)
        self.note_chunk(exchange, chunk)
        return chunk

    def note_chunk(self, exchange: Exchange, chunk: bytes) -> None:
        """A piece of the answer on its way to the client (through this hop or past the
        endpoint picker): captured for the tokenizer, its usage read for the tenant's limits,
        and the first one marks the prompt computed (TTFT)."""
        if exchange.capture is not None:
            exchange.capture.feed(chunk)
        if exchange.limits is not None:
            used = usage_tokens(chunk)
            exchange.used = used if used is not None else exchange.used
        if exchange.first_chunk:
            exchange.first_chunk = False
            if exchange.attempt is not None:
                exchange.attempt.prefilled()
            self.metrics.ttft_seconds.labels(exchange.routed.tier.name).observe(
                time.perf_counter() - exchange.started
            )

    # -- resuming ----------------------------------------------------------------------------
    async def _resume(
        self,
        route: Route,
        failed: ReplicaState,
        resumable: Resumable,
        ledger: StreamLedger,
        tried: set[str],
    ) -> _Leg | bytes | None:
        """Continue a broken stream on another replica of the route's group: the request
        extended by what the client was sent (``resume.continuation``). Returns the next leg
        (its attempt begun); the stream's closing bytes when nothing was left to generate;
        None when it cannot continue (counted by outcome)."""
        tier = route.tier.name
        outcome = self.metrics.stream_resumes
        if resumable.left <= 0:
            outcome.labels(tier, "exhausted").inc()
            return None
        sent = read_sent(resumable.kind, ledger)
        if sent.not_resumable is not None:
            log.info("stream not resumed", extra={"tier": tier, "why": sent.not_resumable})
            outcome.labels(tier, "not_resumable").inc()
            return None
        if sent.finished:
            outcome.labels(tier, "resumed").inc()
            return closing(resumable.kind, sent)
        replica = self.router.alternative(route, tried)
        if replica is None:
            outcome.labels(tier, "no_replica").inc()
            return None
        tried.add(replica.id)
        resumable.left -= 1
        attempt = Attempt(replica).begin()
        handed_over = False
        try:
            count = await self._count_tokens(replica, sent) if sent.text else 0
            body = continuation(resumable.kind, resumable.body, sent, count)
            if body is None:
                outcome.labels(tier, "resumed").inc()
                return closing(resumable.kind, sent)
            response = await self._continue(route, replica, resumable, json_bytes(body))
            if response is None:
                outcome.labels(tier, "failed").inc()
                return None
            log.info(
                "stream resumed",
                extra={"tier": tier, "from": failed.id, "to": replica.id, "sent_tokens": count},
            )
            outcome.labels(tier, "resumed").inc()
            handed_over = True
            return _Leg(replica, response, attempt, Rewriter(resumable.kind, sent, count))
        finally:
            if not handed_over:
                attempt.end()

    async def _continue(
        self, route: Route, replica: ReplicaState, resumable: Resumable, payload: bytes
    ) -> aiohttp.ClientResponse | None:
        """The continuation's streaming response from ``replica``, or None (a failure
        recorded, or a refusal)."""
        budget_s = self.router.first_byte_timeout_s(route.tier)
        try:
            async with self.upstream.watch(replica, budget_s, keep_while_alive=True):
                response = await self.upstream.session.post(
                    replica.url(resumable.path),
                    data=payload,
                    headers=resumable.headers,
                    timeout=self.upstream.timeout(),
                )
        except (SilentReplicaError, aiohttp.ClientError) as exc:
            self.upstream.failed(route, replica, cause_of(exc))
            return None
        if response.status != 200 or response.content_type != "text/event-stream":
            log.warning(
                "stream continuation refused",
                extra={"replica": replica.id, "status": response.status},
            )
            response.close()
            return None
        return response

    async def _count_tokens(self, replica: ReplicaState, sent: Sent) -> int:
        """The tokens of the text sent, by the replica's own tokenizer (vLLM's ``/tokenize``);
        the number of events that carried it when the replica cannot say (an event is a token
        unless the engine batches them)."""
        body = tokenize_request(sent)
        try:
            async with self.upstream.session.post(
                replica.url("/tokenize"),
                data=json_bytes(body),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(
                    total=2 * self.router.config.connect_timeout.total_seconds()
                ),
            ) as answer:
                if answer.status == 200:
                    count = (await answer.json()).get("count")
                    if isinstance(count, int):
                        return count
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        return sent.events


async def stream_error(out: web.StreamResponse, status: int, message: str) -> None:
    """An error event mid-stream, shaped as vLLM's (its HTTP status is already sent)."""
    event = b"data: " + json_bytes(error_body(status, message)) + b"\n\n"
    with contextlib.suppress(ConnectionError):
        await out.write(event)


# The tokens an answer's usage counts, found without parsing the answer: in JSON a quote
# inside a string is escaped, so '"usage"' can only be the key, and total_tokens follows it.
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


def usage_tokens(data: bytes) -> int | None:
    """``usage.total_tokens`` (prompt and completion) of a JSON answer or of the last event
    carrying one in a chunk of a streamed answer (vLLM sends it in the final event when the
    client asks ``stream_options.include_usage``); None when there is none."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    found = _TOTAL_TOKENS.search(data, at)
    return int(found.group(1)) if found is not None else None
