"""The HTTP work of one request: read and check it, ask the router where it goes, send it
(two hops for a disaggregated tier), retry before the first byte, and relay the answer -
streamed chunk by chunk as it arrives, never buffered.

Upstream client: one pooled ``aiohttp.ClientSession``. ``bench/router_client.py`` measured it
against ``httpx.AsyncClient`` on the same echo backend; aiohttp had the lower per-request cost
(numbers in ``bench/results/router_client.json``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import web

from fleetpilot.httpserver import content_type_refusal, is_json_content_type
from fleetpilot.openai_errors import error_body, normalize_error
from fleetpilot.routing.admission import Admission, Entry
from fleetpilot.routing.auth import AuthGate, Tenant
from fleetpilot.routing.errors import (
    BodyTooLargeError,
    InvalidRequestError,
    RouterError,
    UpstreamFailedError,
    UpstreamTimeoutError,
    model_not_found,
)
from fleetpilot.routing.features import Kind, RequestFeatures, extract_features
from fleetpilot.routing.health import answers_health
from fleetpilot.routing.limits import (
    DEFAULT_COMPLETION_RESERVE,
    RateLimitedError,
    TenantLimits,
)
from fleetpilot.routing.liveness import LivenessWatch, SilentReplicaError
from fleetpilot.routing.metrics import RouterMetrics
from fleetpilot.routing.policies.pd import (
    KV_TRANSFER_PARAMS,
    client_body,
    decode_request,
    kv_params_of,
    prefill_request,
)
from fleetpilot.routing.replies import REPLY_CAPTURE_TOTAL_BYTES, CaptureBudget, ReplyCapture
from fleetpilot.routing.resume import (
    Rewriter,
    Sent,
    StreamLedger,
    closing,
    continuation,
    read_sent,
    resumable_body,
    tokenize_request,
)
from fleetpilot.routing.router import ReplicaState, Route, Router

log = logging.getLogger(__name__)

ROUTE_HEADER = "x-fleetpilot-route"
REQUEST_ID_HEADER = "X-Request-Id"
PATHS: dict[Kind, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Client headers an engine may need; everything else (cookies, hop-by-hop headers, Host) stays
# here. Authorization is forwarded for engines started with --api-key, and never logged.
FORWARDED_HEADERS = ("Authorization", "Accept", "traceparent", "tracestate")
# Upstream answer headers worth relaying; lengths and encodings are the server's own business.
RELAYED_HEADERS = ("Content-Type", "Cache-Control")
STATUS_CLIENT_CLOSED = "499"  # nginx's code for "client closed the request"
# The cause of an attempt that got no first byte within its budget from a replica that then
# failed its liveness probe: frozen (SIGSTOP), wedged, or its node gone without a RST.
FIRST_BYTE_TIMEOUT = "first-byte-timeout"
# The cause of an attempt given up before its budget because its replica turned suspect
# (policies.suspicion) while another could take the request: retried, counted as no failure
# (the replica's own missed scrapes count towards its ejection).
SUSPECT = "suspect"
# The /health question asked of a replica where a request has waited ``suspect_after_s``:
# a live engine's API server answers it in milliseconds (vLLM's does not wait on the engine
# core); a quarter second covers a busy event loop, and a wrong "silent" costs little - the
# replica is passed over only until its next scrape or answer.
SUSPICION_PROBE_S = 0.25
# Causes that are waits which ran out (the replica said nothing), not quick refusals: an
# ejection they led to is not worth a try in panic mode (``picker.HealthFilter``).
HUNG_CAUSES = frozenset({"timeout", FIRST_BYTE_TIMEOUT, "stall"})
# The cause of an attempt answered 404 for its LoRA adapter by a healthy replica that has not
# loaded it yet (dynamic LoRA): retried like a failure, counted as none.
ADAPTER_MISSING = "adapter-missing"
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


@dataclass
class _Exchange:
    """Bookkeeping of one client request."""

    started: float
    # Whose key the request carries (routing.auth); None without auth.
    tenant: Tenant | None = None
    # The tenant's buckets when it has limits: what admission reserved, the rate-limit
    # headers of the answer, and the tokens the answer says it used (usage), when it says.
    limits: TenantLimits | None = None
    reserved: int = 0
    rate_headers: dict[str, str] = field(default_factory=dict)
    answered: bool = False  # an engine answered 200: tokens were spent
    used: int | None = None
    route: Route | None = None
    response: web.StreamResponse | None = None
    replica: ReplicaState | None = None
    request_id: str = ""
    counted: bool = False
    # The replica whose pending_prefill holds this request's prompt blocks, until its first
    # chunk (or the end of the attempt) takes them off.
    prefilling: ReplicaState | None = None
    prefill_blocks: int = 0
    # Its standing in admission: counts, turn, cold-start hold.
    entry: Entry = field(default_factory=Entry)

    def begin_prefill(self, replica: ReplicaState, blocks: int) -> None:
        self.end_prefill()
        self.prefilling, self.prefill_blocks = replica, blocks
        replica.pending_prefill += blocks

    def end_prefill(self) -> None:
        if self.prefilling is not None:
            self.prefilling.pending_prefill -= self.prefill_blocks
            self.prefilling = None


@dataclass
class _Resumable:
    """What continuing a stream on another replica needs (routing.streamResumes)."""

    kind: Kind
    body: dict[str, Any]  # the client's request, as engines are sent it
    path: str
    headers: dict[str, str]
    left: int  # continuations this request may still have


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def error_response(error: RouterError) -> web.Response:
    return web.Response(
        status=error.status,
        body=_json_bytes(error.body()),
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
        self.debug_route_header = debug_route_header
        # API keys (routing.auth): None or a gate without a ring admits every request.
        self.auth = auth
        self.admission: Admission[Route] = Admission(router, metrics, self._route)
        self._client_timeout: aiohttp.ClientTimeout | None = None
        self._tokenize_pool = ThreadPoolExecutor(
            TOKENIZE_WORKERS, thread_name_prefix="fleetpilot-tokenize"
        )
        self._remember_pool = ThreadPoolExecutor(1, thread_name_prefix="fleetpilot-remember")
        self._capture_budget = CaptureBudget(REPLY_CAPTURE_TOTAL_BYTES)
        # The /health questions in flight (``_question``), one per replica at most.
        self._questions: dict[str, asyncio.Task[None]] = {}

    def close(self) -> None:
        """Stop the worker threads (a prompt being tokenized finishes; queued work is dropped)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._remember_pool.shutdown(wait=False, cancel_futures=True)
        for task in self._questions.values():
            task.cancel()

    # -- entry -------------------------------------------------------------------------------
    async def handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        """Admission from the headers alone (key, Content-Type, the client's unfinished
        requests, the tenant's request rate), then the body; only a request whose body has
        arrived counts against ``maxInFlight``, so clients sending bodies slowly - each cut by
        the listener's body rule (``httpserver.body_verdict``) - cannot fill it (issue 41)."""
        tenant: Tenant | None = None
        ring = self.auth.ring if self.auth is not None else None
        if ring is not None:
            # Before any routing work, the body not even read: a request without a valid key
            # costs a digest and a header.
            try:
                tenant = ring.authenticate(request.headers.get("Authorization"))
            except RouterError as exc:
                return self._reject(exc)
            self.metrics.tenant_requests.labels(tenant.name).inc()
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
            return await self._admitted(request, kind, tenant)
        finally:
            self.admission.close_client(client)

    async def _admitted(
        self, request: web.Request, kind: Kind, tenant: Tenant | None
    ) -> web.StreamResponse:
        config = self.router.config
        exchange = _Exchange(started=time.perf_counter(), tenant=tenant, entry=Entry(tenant))
        try:
            async with asyncio.timeout(config.request_timeout.total_seconds()):
                return await self._handle(request, kind, exchange)
        except RouterError as exc:
            if exchange.response is not None:
                return exchange.response
            if exchange.route is not None:
                # Routed, then failed upstream: say where it went.
                exc.headers = {
                    **exc.headers,
                    ROUTE_HEADER: self._route_header(exchange.route, exchange.replica),
                }
            return self._reject(exc)
        except asyncio.CancelledError:
            # The client left (handler cancellation) before its answer was complete: count it
            # as proxies do, whichever await it left in (a non-streamed request spends its
            # whole wait inside the upstream call, before any relaying).
            self._count(exchange, STATUS_CLIENT_CLOSED)
            raise
        except TimeoutError:
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
                self._upstream_failed(exchange.route, exchange.replica, "timeout")
            if exchange.response is not None:
                # Mid-stream: the status is sent; end the stream with an error event.
                await self._stream_error(exchange.response, 504, "request timeout exceeded")
                self._count(exchange, "504")
                return exchange.response
            self._count(exchange, "504")
            return error_response(
                UpstreamTimeoutError(
                    "the request exceeded the router's request timeout", reason="timeout"
                )
            )
        finally:
            self.admission.finish(exchange.entry)
            if exchange.limits is not None:
                # Nothing generated (refused, failed): the reserve back; else what the answer
                # says it used, when it says.
                used = exchange.used if exchange.answered else 0
                exchange.limits.settle(exchange.reserved, used, time.monotonic())

    def _route_header(
        self, route: Route, replica: ReplicaState | None = None, prefill: str | None = None
    ) -> str:
        addresses = self.debug_route_header or self.router.config.debug_route_header
        return route.header(replica, prefill, addresses=addresses)

    def _reject(self, error: RouterError) -> web.Response:
        self.metrics.rejected.labels(str(error.status), error.reason or "").inc()
        return error_response(error)

    def _count(self, exchange: _Exchange, status: str) -> None:
        route = exchange.route
        if route is None or exchange.counted:
            return
        exchange.counted = True
        replica = exchange.replica or route.replica
        tier = route.tier.name
        self.metrics.count_request(tier, replica.id, status, time.perf_counter() - exchange.started)

    # -- one request -------------------------------------------------------------------------
    async def _handle(
        self, request: web.Request, kind: Kind, exchange: _Exchange
    ) -> web.StreamResponse:
        config = self.router.config
        limits = self._tenant_limits(exchange)
        if limits is not None:
            # The request itself is taken now, from the headers: a key at its request limit
            # gets 429 before it may send (or trickle) a body. Its tokens, once parsed.
            exchange.rate_headers = limits.admit_request(time.monotonic())
            exchange.limits = limits
        raw = await _read_body(request, config.max_body_bytes)
        self.admission.take_in_flight(exchange.entry)
        if len(raw) > PARSE_OFF_LOOP_BYTES:
            loop = asyncio.get_running_loop()
            body, features = await loop.run_in_executor(
                self._tokenize_pool, _parse, raw, kind, request.headers
            )
        else:
            body, features = _parse(raw, kind, request.headers)
        if exchange.tenant is not None:
            tenant = exchange.tenant
            features = replace(
                features,
                allowed_tiers=tenant.allowed_tiers,
                allowed_adapters=tenant.allowed_adapters,
            )
            self._admit(exchange, features)
        decided = time.perf_counter()
        route = await self.admission.decide(features, exchange.entry)
        self.metrics.decision_seconds.observe(time.perf_counter() - decided)
        exchange.route = route
        tier = route.tier
        self.metrics.count_decision(
            tier.name, route.reason, route.prefix_match, route.prefix_source
        )
        if route.tokenizer_failed:
            self.metrics.tokenizer_errors.labels(tier.name).inc()
        if route.spilled_from is not None:
            self.metrics.spillovers.labels(route.spilled_from, tier.name).inc()

        headers = _upstream_headers(request)
        if exchange.tenant is not None:
            # The tenant's key is the router's to check, not the engines' to see.
            headers.pop("Authorization", None)
        exchange.request_id = headers[REQUEST_ID_HEADER]
        path = PATHS[kind]
        prefill_id: str | None = None
        try:
            if route.local_prefill:  # the decode replica holds the prompt: no hop
                self.metrics.pd_local_prefills.labels(tier.name).inc()
                payload = _json_bytes(client_body(body, route.served_model))
            elif route.disaggregated:
                params, cause = await self._prefill_hop(route, body, path, headers)
                if params is not None:
                    prefill_id = route.prefill.id if route.prefill else None
                    payload = _json_bytes(decode_request(body, route.served_model, params))
                else:
                    self.metrics.pd_fallbacks.labels(tier.name, cause).inc()
                    payload = _json_bytes(client_body(body, route.served_model))
            elif body.get("model") == route.served_model and KV_TRANSFER_PARAMS not in body:
                payload = raw  # the common pinned case: forward the client's bytes untouched
            else:
                payload = _json_bytes(client_body(body, route.served_model))
        except RecursionError:
            raise InvalidRequestError(
                "the request body is nested too deeply", reason="invalid_json"
            ) from None
        capture = self._reply_capture(kind, route, body, len(raw))
        resumable = None
        if features.stream and config.stream_resumes > 0 and resumable_body(kind, body):
            resumable = _Resumable(
                kind, client_body(body, route.served_model), path, headers, config.stream_resumes
            )
        try:
            return await self._send(
                request,
                exchange,
                route,
                path,
                payload,
                headers,
                features.stream,
                prefill_id,
                capture,
                resumable,
            )
        finally:
            if capture is not None:
                capture.drop()  # not handed to the tokenizer: its budget back

    def _tenant_limits(self, exchange: _Exchange) -> TenantLimits | None:
        if exchange.tenant is None or self.auth is None:
            return None
        return self.auth.limiter.of(exchange.tenant.name)

    def _admit(self, exchange: _Exchange, features: RequestFeatures) -> None:
        """Take the request's tokens from the tenant's bucket, or 429 (routing.limits): the
        prompt's estimated tokens and max_tokens are reserved until the answer's usage. The
        request itself was taken from the headers (``_handle``)."""
        limits = exchange.limits
        if limits is None:
            return
        completion = features.max_tokens
        reserve = features.approx_tokens + (
            completion if completion is not None else DEFAULT_COMPLETION_RESERVE
        )
        try:
            exchange.rate_headers = limits.admit_tokens(reserve, time.monotonic())
        except RateLimitedError:
            exchange.limits = None  # nothing reserved: nothing to settle
            raise
        exchange.reserved = reserve

    async def _route(self, features: RequestFeatures) -> Route:
        """The router's decision. A prompt whose tokenizing would stall the loop (a long cold
        one) has its KV-index keys computed in a worker thread first, while the loop relays
        other streams; a cheap one (a conversation's next turn) inline, as a thread hop would
        cost more than it moves."""
        prepared = self.router.prepare_keys(features)
        if prepared is not None and prepared.off_loop:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._tokenize_pool, prepared.compute)
        return self.router.decide(features, prepared)

    def _reply_capture(
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

    async def _prefill_hop(
        self, route: Route, body: dict[str, Any], path: str, headers: dict[str, str]
    ) -> tuple[dict[str, Any] | None, str]:
        """Hop 1 of a disaggregated request: the KV handle, or ``None`` and why not.

        The hop has the tier's first-byte budget: a prefill is one forward pass, and past the
        budget the decode replica computing the prompt itself is the quicker answer. It counts
        as a failure of the prefill replica only if its liveness probe failed too. It is given
        up sooner, counting no failure, once the replica turns suspect (a frozen prefill
        engine costs each hop in flight about a second, not the budget)."""
        replica = route.prefill
        if replica is None:
            return None, "no-prefill-replica"
        payload = _json_bytes(prefill_request(body, route.served_model))
        budget_s = self.router.first_byte_timeout_s(route.tier)
        replica.in_flight += 1
        # The hop is the prefill: its blocks are pending on the replica until it answers.
        replica.pending_prefill += route.prefill_blocks
        now = self.router.clock
        try:
            # Given up as soon as the replica turns suspect: decode-only is always there.
            async with self._watch(
                replica, budget_s, keep_while_alive=False, give_up=lambda: replica.suspect(now())
            ):
                status, data = await self._prefill_exchange(replica, path, payload, headers)
        except SilentReplicaError as exc:
            if exc.verdict == "dead":
                self._upstream_failed(route, replica, FIRST_BYTE_TIMEOUT)
                return None, "prefill-" + FIRST_BYTE_TIMEOUT
            if exc.verdict == SUSPECT:
                return None, "prefill-" + SUSPECT
            return None, "prefill-slow"
        except aiohttp.ClientError as exc:
            self._upstream_failed(route, replica, _cause(exc))
            return None, "prefill-" + _cause(exc)
        except ValueError:
            return None, "prefill-invalid-json"
        finally:
            replica.in_flight -= 1
            replica.pending_prefill -= route.prefill_blocks
        if status >= 500:
            self._upstream_failed(route, replica, "5xx")
            return None, "prefill-5xx"
        if status != 200:
            return None, f"prefill-{status}"
        params = kv_params_of(data)
        if params is None:
            return None, "prefill-no-kv-params"
        self.router.record_success(replica)
        return params, "ok"

    async def _prefill_exchange(
        self, replica: ReplicaState, path: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, Any]:
        async with self.session.post(
            replica.url(path), data=payload, headers=headers, timeout=self._timeout()
        ) as response:
            if response.status != 200:
                return response.status, None
            return 200, await response.json(content_type=None)

    def _watch(
        self,
        replica: ReplicaState,
        budget_s: float,
        *,
        keep_while_alive: bool,
        give_up: Callable[[], bool] | None = None,
    ) -> _ReplicaWatch:
        """The first-byte watch of one attempt on ``replica``; ``give_up`` is asked once the
        attempt has waited as long as makes a silent replica suspect."""
        return _ReplicaWatch(
            replica,
            self.router.clock,
            self._probe(replica),
            budget_s,
            keep_while_alive=keep_while_alive,
            give_up=give_up,
            give_up_after_s=replica.suspect_after_s,
            on_due=(lambda: self._question(replica)) if give_up is not None else None,
        )

    def _question(self, replica: ReplicaState) -> None:
        """A request has waited long enough on ``replica`` to ask whether it is alive: its
        /health, within ``SUSPICION_PROBE_S``, unless it is known silent already or asked now.
        No answer makes it silent, so suspect (``policies.suspicion``) a scrape period sooner
        than a missed scrape would."""
        if replica.silent_since is not None or replica.id in self._questions:
            return
        probe = self._probe(replica)

        async def ask() -> None:
            try:
                await probe(SUSPICION_PROBE_S)
            finally:
                self._questions.pop(replica.id, None)

        self._questions[replica.id] = asyncio.get_running_loop().create_task(ask())

    def _timeout(self) -> aiohttp.ClientTimeout:
        connect = self.router.config.connect_timeout.total_seconds()
        if self._client_timeout is None or self._client_timeout.connect != connect:
            # No total or read limit here: the request-wide asyncio.timeout bounds the whole
            # exchange, and a long generation legitimately streams for minutes.
            self._client_timeout = aiohttp.ClientTimeout(
                total=None, connect=connect, sock_connect=connect
            )
        return self._client_timeout

    def _upstream_failed(self, route: Route, replica: ReplicaState, cause: str) -> None:
        self.metrics.upstream_errors.labels(route.tier.name, replica.id, cause).inc()
        if cause != SUSPECT:
            # The router's on_eject counts an ejection.
            self.router.record_failure(replica, hung=cause in HUNG_CAUSES)

    def _adapter_missing(self, route: Route, replica: ReplicaState) -> None:
        assert route.adapter is not None
        self.metrics.adapter_missing.labels(route.tier.name, replica.id).inc()
        self.router.record_adapter_missing(replica, route.adapter)

    async def _send(
        self,
        request: web.Request,
        exchange: _Exchange,
        route: Route,
        path: str,
        payload: bytes,
        headers: dict[str, str],
        stream: bool,
        prefill_id: str | None,
        capture: ReplyCapture | None = None,
        resumable: _Resumable | None = None,
    ) -> web.StreamResponse:
        """Send to the route's replica; on a connect error, a disconnect before the answer, a
        5xx, or a 404 saying the replica lacks the request's LoRA adapter, try another replica
        of the same group, up to ``retries`` more times."""
        replica = route.replica
        tried = {replica.id}
        retries_left = self.router.config.retries
        timeout = self._timeout()
        budget_s = self.router.first_byte_timeout_s(route.tier)
        now = self.router.clock

        def give_up() -> bool:
            # A suspect replica's wait goes to a sound one, while a retry is left for it.
            return (
                retries_left > 0
                and attempt.suspect(now())
                and self.router.has_sound_peer(route, tried)
            )

        while True:
            exchange.replica = replica
            attempt = replica  # `replica` moves on for a retry; this attempt's count stays here
            attempt.in_flight += 1
            # A P/D decode replica prefills nothing (it pulls the KV), unless it was sent the
            # request to prefill the few tokens it lacks itself.
            if not route.disaggregated or route.local_prefill:
                exchange.begin_prefill(attempt, route.prefill_blocks)
            try:
                response: aiohttp.ClientResponse | None = None
                cause: str | None = None
                error: Exception | None = None
                try:
                    async with self._watch(
                        replica, budget_s, keep_while_alive=True, give_up=give_up
                    ):
                        response = await self.session.post(
                            replica.url(path), data=payload, headers=headers, timeout=timeout
                        )
                    cause = "5xx" if response.status >= 500 else None
                except SilentReplicaError as exc:
                    cause = SUSPECT if exc.verdict == SUSPECT else FIRST_BYTE_TIMEOUT
                except aiohttp.ClientError as exc:
                    cause = _cause(exc)
                    error = exc
                if cause is None and route.adapter is not None and await _lacks_model(response):
                    cause = ADAPTER_MISSING
                    self.router.record_success(replica)  # it answered: no failure
                    self._adapter_missing(route, replica)
                elif cause is not None:
                    self._upstream_failed(route, replica, cause)
                if cause is not None:
                    alternative = (
                        self.router.alternative(route, tried) if retries_left > 0 else None
                    )
                    if alternative is None and cause == "disconnect" and retries_left > 0:
                        # Dropped before any answer and no other replica: most likely a pooled
                        # keep-alive connection the replica had closed (a restart). A fresh
                        # connection to the same replica is worth one try.
                        alternative = replica
                    if alternative is not None:
                        if response is not None:
                            response.close()
                        log.info(
                            "retrying",
                            extra={
                                "tier": route.tier.name,
                                "from": replica.id,
                                "to": alternative.id,
                                "cause": cause,
                            },
                        )
                        self.metrics.retries.labels(route.tier.name).inc()
                        retries_left -= 1
                        tried.add(alternative.id)
                        replica = alternative
                        continue
                    if response is None:
                        if cause in ("timeout", FIRST_BYTE_TIMEOUT, SUSPECT):
                            self._count(exchange, "504")
                            raise UpstreamTimeoutError(
                                f"no replica of tier {route.tier.name} answered in time "
                                f"({cause}; first-byte budget {budget_s:g}s)",
                                reason="upstream_timeout",
                            ) from error
                        self._count(exchange, "502")
                        raise UpstreamFailedError(
                            f"no replica of tier {route.tier.name} could be reached ({cause})",
                            reason="upstream_unreachable",
                        ) from error
                else:
                    self.router.record_success(replica)
                assert response is not None
                if cause is None and route.adapter is not None and response.status < 400:
                    self.router.record_adapter_served(replica, route.adapter)
                return await self._relay(
                    request,
                    exchange,
                    route,
                    replica,
                    response,
                    stream,
                    prefill_id,
                    capture,
                    resumable,
                )
            finally:
                attempt.in_flight -= 1
                exchange.end_prefill()

    async def _relay(
        self,
        request: web.Request,
        exchange: _Exchange,
        route: Route,
        replica: ReplicaState,
        response: aiohttp.ClientResponse,
        stream: bool,
        prefill_id: str | None,
        capture: ReplyCapture | None = None,
        resumable: _Resumable | None = None,
    ) -> web.StreamResponse:
        """Pass the upstream answer through, status and all (a successful chat reply also to
        ``capture``)."""
        out_headers = {h: v for h in RELAYED_HEADERS if (v := response.headers.get(h))}
        out_headers[ROUTE_HEADER] = self._route_header(route, replica, prefill_id)
        out_headers[REQUEST_ID_HEADER] = exchange.request_id
        out_headers.update(exchange.rate_headers)
        exchange.answered = response.status < 400
        content_type = response.headers.get("Content-Type", "")
        status = str(response.status)
        done = False
        try:
            if not (stream and content_type.startswith("text/event-stream")):
                data = await response.read()
                done = True
                if response.status >= 400:
                    # An engine error is relayed in the router's own (vLLM's) shape, whatever
                    # shape the engine wrote it in.
                    fixed = normalize_error(response.status, data)
                    if fixed is not None:
                        data = fixed
                        out_headers["Content-Type"] = "application/json"
                self._count(exchange, status)
                if exchange.limits is not None and exchange.answered:
                    exchange.used = usage_tokens(data)
                if capture is not None and response.status == 200:
                    capture.feed(data)
                    capture.remember(self._remember_pool, streamed=False)
                return web.Response(status=response.status, body=data, headers=out_headers)
            out = web.StreamResponse(status=response.status, headers=out_headers)
            out.enable_chunked_encoding()
            await out.prepare(request)
            exchange.response = out
            whole = await self._relay_stream(
                out,
                exchange,
                route,
                replica,
                response,
                capture,
                resumable if response.status == 200 else None,
            )
            if not whole:
                return out  # counted: the stream broke, or the client left
            done = True
            self._count(exchange, status)  # the client has every byte of the answer now
            if capture is not None and response.status == 200:
                capture.remember(self._remember_pool, streamed=True)
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
                self._count(exchange, STATUS_CLIENT_CLOSED)
            raise
        finally:
            if done:
                response.release()
            else:
                response.close()

    async def _relay_stream(
        self,
        out: web.StreamResponse,
        exchange: _Exchange,
        route: Route,
        replica: ReplicaState,
        response: aiohttp.ClientResponse,
        capture: ReplyCapture | None,
        resumable: _Resumable | None,
    ) -> bool:
        """Relay a streamed answer as it comes. When its replica dies (the connection breaks,
        or it goes silent and fails a liveness probe: ``liveness.LivenessWatch``) and the
        request can be resumed, the answer continues on another replica (``_resume``) in the
        same client stream. True when the client has the whole answer; otherwise it was told
        (an error event) or it left, and the request is counted."""
        ledger = StreamLedger() if resumable is not None else None
        rewriter: Rewriter | None = None
        leg, leg_replica = response, replica
        tried = {replica.id}
        budget_s = self.router.first_byte_timeout_s(route.tier)
        first = True
        try:
            while True:
                cause: str | None = None
                try:
                    async with LivenessWatch(self._probe(leg_replica), budget_s) as watch:
                        while True:
                            chunk = await leg.content.readany()
                            watch.progress()
                            if not chunk:
                                break
                            if ledger is not None:
                                chunk = ledger.whole(chunk)
                                if not chunk:
                                    continue
                                if rewriter is not None:
                                    chunk = rewriter.events(chunk)
                                ledger.record(chunk)
                            if capture is not None:
                                capture.feed(chunk)
                            if exchange.limits is not None:
                                used = usage_tokens(chunk)
                                exchange.used = used if used is not None else exchange.used
                            if first:
                                first = False
                                exchange.end_prefill()
                                self.metrics.ttft_seconds.labels(route.tier.name).observe(
                                    time.perf_counter() - exchange.started
                                )
                            try:
                                await out.write(chunk)
                            except ConnectionError:
                                # The client left: closing the upstream response (the caller
                                # or below) cancels the generation on the engine.
                                self._count(exchange, STATUS_CLIENT_CLOSED)
                                return False
                except SilentReplicaError:
                    cause = "stall"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    cause = "stream"
                    log.warning(
                        "upstream stream broke",
                        extra={"replica": leg_replica.id, "err": type(exc).__name__},
                    )
                if cause is None and (ledger is None or ledger.done):
                    if ledger is not None and (rest := ledger.rest()):
                        with contextlib.suppress(ConnectionError):
                            await out.write(rest)
                    return True
                # Broken, frozen, or ended without [DONE] (an engine shutting down).
                self._upstream_failed(route, leg_replica, cause or "stream")
                leg.close()
                resumed = None
                if resumable is not None and ledger is not None:
                    resumed = await self._resume(route, leg_replica, resumable, ledger, tried)
                if isinstance(resumed, bytes):  # the answer was whole: only its end was lost
                    with contextlib.suppress(ConnectionError):
                        await out.write(resumed)
                    return True
                if resumed is None:
                    await self._stream_error(out, 502, "the upstream replica stopped mid-stream")
                    self._count(exchange, "502")
                    return False
                if leg_replica is not replica:
                    leg_replica.in_flight -= 1
                leg_replica, leg, rewriter = resumed
                exchange.replica = leg_replica
        finally:
            if leg is not response:
                leg.close()
                leg_replica.in_flight -= 1

    async def _resume(
        self,
        route: Route,
        failed: ReplicaState,
        resumable: _Resumable,
        ledger: StreamLedger,
        tried: set[str],
    ) -> tuple[ReplicaState, aiohttp.ClientResponse, Rewriter] | bytes | None:
        """Continue a broken stream on another replica of the route's group: the request
        extended by what the client was sent (``resume.continuation``). Returns the new
        replica (its in_flight counted), its streaming response and the rewriter of its
        events; the stream's closing bytes when nothing was left to generate; None when it
        cannot continue (counted by outcome)."""
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
        replica.in_flight += 1
        handed_over = False
        try:
            count = await self._count_tokens(replica, sent) if sent.text else 0
            body = continuation(resumable.kind, resumable.body, sent, count)
            if body is None:
                outcome.labels(tier, "resumed").inc()
                return closing(resumable.kind, sent)
            budget_s = self.router.first_byte_timeout_s(route.tier)
            try:
                async with self._watch(replica, budget_s, keep_while_alive=True):
                    response = await self.session.post(
                        replica.url(resumable.path),
                        data=_json_bytes(body),
                        headers=resumable.headers,
                        timeout=self._timeout(),
                    )
            except (SilentReplicaError, aiohttp.ClientError) as exc:
                self._upstream_failed(route, replica, _cause(exc))
                outcome.labels(tier, "failed").inc()
                return None
            if response.status != 200 or response.content_type != "text/event-stream":
                log.warning(
                    "stream continuation refused",
                    extra={"replica": replica.id, "status": response.status},
                )
                response.close()
                outcome.labels(tier, "failed").inc()
                return None
            log.info(
                "stream resumed",
                extra={"tier": tier, "from": failed.id, "to": replica.id, "sent_tokens": count},
            )
            outcome.labels(tier, "resumed").inc()
            handed_over = True
            return replica, response, Rewriter(resumable.kind, sent, count)
        finally:
            if not handed_over:
                replica.in_flight -= 1

    async def _count_tokens(self, replica: ReplicaState, sent: Sent) -> int:
        """The tokens of the text sent, by the replica's own tokenizer (vLLM's ``/tokenize``);
        the number of events that carried it when the replica cannot say (an event is a token
        unless the engine batches them)."""
        body = tokenize_request(sent)
        try:
            async with self.session.post(
                replica.url("/tokenize"),
                data=_json_bytes(body),
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

    def _probe(self, replica: ReplicaState) -> Callable[[float], Awaitable[bool]]:
        async def probe(timeout_s: float) -> bool:
            alive = await answers_health(self.session, replica, timeout_s)
            if alive:
                replica.heard_from()
            else:
                replica.went_silent(self.router.clock())
            return alive

        return probe

    async def _stream_error(self, out: web.StreamResponse, status: int, message: str) -> None:
        """An error event mid-stream, shaped as vLLM's (its HTTP status is already sent)."""
        event = b"data: " + _json_bytes(error_body(status, message)) + b"\n\n"
        with contextlib.suppress(ConnectionError):
            await out.write(event)


class _ReplicaWatch(LivenessWatch):
    """A first-byte watch that keeps the replica's record of the requests waiting for a first
    byte there (``ReplicaState.waits``, which suspicion reads): every upstream attempt's wait
    goes through one, so this is that record's one writer. An attempt that got its answer
    means the replica was heard from."""

    def __init__(
        self,
        replica: ReplicaState,
        clock: Callable[[], float],
        probe: Callable[[float], Awaitable[bool]],
        budget_s: float,
        *,
        keep_while_alive: bool,
        give_up: Callable[[], bool] | None,
        give_up_after_s: float,
        on_due: Callable[[], None] | None,
    ) -> None:
        super().__init__(
            probe,
            budget_s,
            keep_while_alive=keep_while_alive,
            give_up=give_up,
            give_up_after_s=give_up_after_s,
            on_due=on_due,
        )
        self.replica = replica
        self.clock = clock
        self._token: int | None = None

    async def __aenter__(self) -> _ReplicaWatch:
        await super().__aenter__()
        self._token = self.replica.waits.begin(self.clock())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            # Ended by the watch (its budget, or suspicion): the replica never answered.
            self.replica.waits.end(self._token, given_up=self.verdict in ("dead", SUSPECT))
        if exc_type is None:
            self.replica.heard_from()
        await super().__aexit__(exc_type, exc, tb)


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


def _new_request_id() -> str:
    return f"{_ID_PREFIX}-{next(_id_counter):x}"


def _upstream_headers(request: web.Request) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    for name in FORWARDED_HEADERS:
        value = request.headers.get(name)
        if value is not None:
            headers[name] = value
    # One id across both P/D hops and the logs of every replica the request touches.
    headers[REQUEST_ID_HEADER] = request.headers.get(REQUEST_ID_HEADER) or _new_request_id()
    return headers


async def _lacks_model(response: aiohttp.ClientResponse | None) -> bool:
    """Whether an engine answered that it does not serve the model the request names (vLLM's
    404 ``NotFoundError``, ``errors.model_not_found``). Reads a 404's body, a few bytes of
    JSON that relaying it takes from aiohttp's copy; a body that breaks off says nothing."""
    if response is None or response.status != 404:
        return False
    if response.content_type == "text/event-stream":
        return False
    try:
        raw = await response.read()
    except aiohttp.ClientError:
        return False
    return model_not_found(raw)


def _cause(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    return "disconnect"
