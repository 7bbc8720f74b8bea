"""How the router and the engine listen: aiohttp with limits a hostile or broken client cannot
outlast, and one throttled warning per kind of bad client instead of a traceback per request.

aiohttp on its own logs every malformed request as an ERROR with a full traceback (logger
``aiohttp.server``), has no header-read timeout (a client that sends half a request line holds
its connection until the keep-alive timeout, 3630 s by default for an ``AppRunner``) and no
connection limit. Here:

- a malformed request still gets aiohttp's 400, but is logged as one WARNING line, at most one
  per ``warn_interval_s`` with a count of the ones suppressed since (:class:`Throttle`);
- a connection must deliver complete request headers within ``header_timeout_s`` of opening,
  and a later request on a kept-alive connection within ``header_timeout_s`` of its first byte,
  or it is closed; an idle kept-alive connection lives ``keepalive_timeout_s``;
- a request body (Content-Length or chunked) must keep arriving: after ``body_timeout_s`` its
  average rate since the headers must be at least ``min_body_rate`` bytes a second, and it may
  never pause longer than ``body_idle_timeout_s`` (:func:`body_verdict`). A body cut so is
  answered 408 (OpenAI-shaped, ``Connection: close``) and counted in a throttled warning: a
  client trickling a byte every few seconds holds its connection ~20 s, not the request
  timeout, while a large prompt on a slow link (any rate above ``min_body_rate``) is never cut;
- beyond ``max_connections`` open connections, a new one is closed at once (and counted in a
  throttled warning), so clients that never finish cannot exhaust file descriptors.

Use :func:`start_site` (an ``AppRunner`` plus a listening socket) or :func:`run_app` (the same,
until SIGINT/SIGTERM) instead of aiohttp's ``TCPSite`` / ``web.run_app``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import uvloop
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from fleetpilot.heap import settle_heap
from fleetpilot.listening import listening_on
from fleetpilot.openai_errors import error_body
from fleetpilot.text import one_line

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class ServerLimits:
    """What one listener tolerates. The defaults suit both the router and an engine."""

    # Request headers are a few hundred bytes sent in one write by every real client (an
    # OpenAI SDK, the router's own client, a load balancer): 10 s is generous even on a busy
    # node, and is what Go's servers are commonly given as ReadHeaderTimeout.
    header_timeout_s: float = 10.0
    # Longer than the router's upstream pool keeps idle connections (aiohttp's client: 15 s)
    # so the client, not the server, closes them: no request races a server-side close.
    # 75 s is web.run_app's default, which the router used before.
    keepalive_timeout_s: float = 75.0
    # None: derived from the process's open-file limit when the listener starts (see
    # :func:`connection_budget`); a fixed number here would be too low for a router in front
    # of thousands of clients or too high for a 1024-descriptor default.
    max_connections: int | None = None
    # With max_connections None: the most connections the process opens itself while serving
    # (see connection_budget); None: one per client connection.
    upstream_connections: int | None = None
    # One warning line per kind of bad client per this many seconds.
    warn_interval_s: float = 10.0
    # The body rule is Apache's mod_reqtimeout default (``body=20,MinRate=500``): 20 s for any
    # body, extended by a second for every 500 bytes received. 500 B/s is 4 kbit/s, below any
    # link a client could use at all (a GPRS uplink carries ~20 kbit/s), so a 10 MiB prompt
    # sent over the slowest real link passes, while a client trickling a byte every few
    # seconds is cut after 20 s. 20 s also covers a real client's first body write on a busy
    # machine, as the header timeout does for its headers.
    body_timeout_s: float = 20.0
    min_body_rate: float = 500.0  # bytes a second, averaged since the headers
    # A body that stops for this long is cut whatever it sent before (a client that sent most
    # of a large body at once would otherwise hold its connection for the rest at the rate
    # above). As for headers: nothing real pauses 10 s mid-body; TCP gets there only after
    # about five retransmissions lost in a row (backoff 0.2, 0.4, ..., 6.4 s).
    body_idle_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.header_timeout_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("header_timeout_s and keepalive_timeout_s must be positive")
        if self.body_timeout_s <= 0 or self.body_idle_timeout_s <= 0 or self.min_body_rate <= 0:
            raise ValueError(
                "body_timeout_s, body_idle_timeout_s and min_body_rate must be positive"
            )
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")

    def connection_limit(self) -> int:
        return self.max_connections or connection_budget(self.upstream_connections)


# Descriptors kept out of the connection budget: logs, metrics, the KV-event sockets, the
# upstream pools' spares.
RESERVED_FDS = 64
MIN_CONNECTIONS = 64


def connection_budget(upstream: int | None = None) -> int:
    """Connections this process can hold open: what its open-file limit leaves after a
    reserve, less the connections it opens itself. ``upstream``: at most that many of its own
    (a router opens one per request in flight, and counts a request in flight only once its
    body has arrived: ``backpressure.maxInFlight``), never less than half of it; None: one of
    its own per client connection, so half.

    The soft limit is raised to the hard one first, as Go's runtime does: the soft default
    (often 1024) is a relic of select(2), which nothing here uses.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # not allowed here: live with the soft limit
    usable = soft - RESERVED_FDS
    if upstream is None:
        return max(MIN_CONNECTIONS, usable // 2)
    return max(MIN_CONNECTIONS, usable // 2, usable - upstream)


@dataclass(frozen=True)
class BodyVerdict:
    """What the body rule says of a request body still arriving."""

    cut: str | None  # why it is cut, in words; None: it may go on
    # Seconds from now after which the rule could cut it if no further byte arrived.
    recheck_s: float


def body_verdict(
    elapsed_s: float, received: int, idle_s: float, limits: ServerLimits
) -> BodyVerdict:
    """Whether a request body ``elapsed_s`` into its arrival, ``received`` bytes of it so far,
    the last byte ``idle_s`` ago, is cut (:class:`ServerLimits`: ``body_timeout_s``,
    ``min_body_rate``, ``body_idle_timeout_s``). Purely computational.

    A client sending at ``min_body_rate`` or more always has ``received / min_body_rate >=
    elapsed_s``, so it is never cut for its rate, and a body of known length is complete
    within ``max(body_timeout_s, length / min_body_rate)``, however it is spread over time.
    """
    if idle_s >= limits.body_idle_timeout_s:
        return BodyVerdict(f"no byte of it for {idle_s:.1f}s", 0.0)
    allowed_s = max(limits.body_timeout_s, received / limits.min_body_rate)
    if elapsed_s >= allowed_s:
        return BodyVerdict(
            f"{received} bytes in {elapsed_s:.1f}s, under {limits.min_body_rate:g} bytes/s",
            0.0,
        )
    return BodyVerdict(None, min(limits.body_idle_timeout_s - idle_s, allowed_s - elapsed_s))


def is_json_content_type(value: str | None) -> bool:
    """Whether a request's Content-Type says JSON: ``application/json`` or ``application/
    <anything>+json``, with any parameters (``; charset=utf-8``). Purely computational.

    The OpenAI endpoints of the router and the engine refuse anything else (415), as vLLM's
    server (FastAPI with ``strict_content_type``) parses no other body as JSON: a web page can
    send ``text/plain``, a form type or no type to any address without a CORS preflight, and
    must not be able to start generations so on a fleet without keys. Every JSON client (the
    openai library, the router's own upstream requests) sends ``application/json``.
    """
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    maintype, _, subtype = media.partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))


def content_type_refusal(value: str | None) -> str:
    """The 415 message for a request whose Content-Type is ``value`` (not JSON)."""
    got = f"'{one_line(value, 100)}'" if value else "none"
    return (
        f"unsupported Content-Type ({got}): send the request body as JSON with "
        "'Content-Type: application/json'"
    )


class BodyTimeoutError(web.HTTPRequestTimeout):
    """Raised by the body reads of a request whose body the listener cut (:func:`body_verdict`);
    the listener answers 408 whatever the handler makes of it."""


# How long a connection whose body was cut stays half-closed after its 408, dropping what the
# client still sends, before it is closed: a client reads an answer already in its socket
# buffer within milliseconds; 2 s is Apache's lingering-close read time, and a trickler
# holds nothing meanwhile (its request has ended).
LINGER_S = 2.0
# Timer resolution of the body checks: a check that fires a hair early rearms at least this far.
_MIN_RECHECK_S = 0.05


class Throttle:
    """At most one event let through per ``interval_s``; says how many were held back.

    Purely computational: the caller passes the time.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._next_s = float("-inf")
        self._suppressed = 0

    def admit(self, now_s: float) -> int | None:
        """None: suppress this event. Otherwise log it, with the returned count of events
        suppressed since the last one let through."""
        if now_s < self._next_s:
            self._suppressed += 1
            return None
        suppressed, self._suppressed = self._suppressed, 0
        self._next_s = now_s + self.interval_s
        return suppressed


class _ThrottledWarnings:
    """One throttle per kind of client trouble, logging to this module's logger."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._throttles: dict[str, Throttle] = {}

    def warn(self, kind: str, message: str, *args: object) -> None:
        throttle = self._throttles.setdefault(kind, Throttle(self._interval_s))
        suppressed = throttle.admit(self._clock())
        if suppressed is None:
            return
        if suppressed:
            message += f" ({suppressed} more in the last {self._interval_s:g}s not logged)"
        log.warning(message, *args)


class _ServerLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Stands in for aiohttp's ``aiohttp.server`` logger inside its RequestHandler.

    aiohttp reports a request it could not parse through ``logger.exception(...,
    exc_info=HttpProcessingError)``; that is the client's fault, not ours: one throttled
    warning. Anything else (a handler that crashed past our middlewares) keeps its traceback.
    """

    def __init__(self, warnings: _ThrottledWarnings) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self._warnings = warnings

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            remote = args[0] if args else "?"
            self._warnings.warn(
                "malformed", "malformed HTTP request from %s: %s", remote, one_line(str(exc))
            )
            return
        super().exception(msg, *args, **kwargs)


class _Connections:
    """The guards of one listener's open connections, and the limits they enforce."""

    def __init__(self, limits: ServerLimits, warnings: _ThrottledWarnings) -> None:
        self.limits = limits
        self.max_connections = limits.connection_limit()
        self.warnings = warnings
        self.open: dict[RequestHandler, _Guard] = {}


class _Guard(asyncio.Protocol):
    """Wraps one aiohttp RequestHandler: refuses it past the connection limit and closes it
    when request headers do not arrive in time. Everything else goes straight through.

    Whether the headers are complete is learnt from the request reaching the application
    (:func:`_request_started`): aiohttp gives protocols no other public signal.
    """

    def __init__(self, handler: RequestHandler, connections: _Connections) -> None:
        self.handler = handler
        self.connections = connections
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a request is in the application
        self._deadline: asyncio.TimerHandle | None = None
        # The body of the request in the application while it still arrives (the body rule).
        self._body: StreamReader | None = None
        self._body_check: asyncio.TimerHandle | None = None
        self._body_since = 0.0  # loop time the rule started counting from
        self._body_base = 0  # bytes of the body received before then
        self._body_seen = 0  # bytes received at the last check
        self._body_progress = 0.0  # loop time a check last saw new bytes
        # Why the body was cut (408 answered, connection closed after it); None: it was not.
        self.body_cut: str | None = None
        self._linger: asyncio.TimerHandle | None = None

    # -- the header deadline -------------------------------------------------------------
    def arm(self) -> None:
        if self._deadline is None and self.transport is not None:
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(
                self.connections.limits.header_timeout_s, self._expired
            )

    def disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.busy or self.transport is None:
            return
        peer = self.transport.get_extra_info("peername")
        self.connections.warnings.warn(
            "header-timeout",
            "closed a connection from %s: no complete request headers within %gs",
            peer[0] if isinstance(peer, tuple) else peer,
            self.connections.limits.header_timeout_s,
        )
        self.transport.abort()

    # -- the body rule -------------------------------------------------------------------
    def begin_body(self, body: StreamReader) -> None:
        """The request in the application has a body still arriving: hold it to the rule."""
        if self.transport is None:
            return
        now = asyncio.get_running_loop().time()
        self._body = body
        self._body_since = self._body_progress = now
        self._body_base = self._body_seen = body.total_bytes
        self.body_cut = None
        self._check_body()

    def end_body(self) -> None:
        self._body = None
        if self._body_check is not None:
            self._body_check.cancel()
            self._body_check = None

    def _check_body(self) -> None:
        self._body_check = None
        body = self._body
        if body is None or body.is_eof() or self.transport is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if getattr(self.handler, "_reading_paused", False):
            # aiohttp's flow control holds the socket (the application reads slower than the
            # body comes): our delay, not the client's. The rule starts over from here.
            self._body_since = self._body_progress = now
            self._body_base = body.total_bytes
        if body.total_bytes != self._body_seen:
            self._body_seen = body.total_bytes
            self._body_progress = now
        verdict = body_verdict(
            now - self._body_since,
            self._body_seen - self._body_base,
            now - self._body_progress,
            self.connections.limits,
        )
        if verdict.cut is None:
            delay = max(_MIN_RECHECK_S, verdict.recheck_s)
            self._body_check = loop.call_later(delay, self._check_body)
            return
        self.body_cut = verdict.cut
        peer = self.transport.get_extra_info("peername")
        self.connections.warnings.warn(
            "body-timeout",
            "cut a request body from %s: %s",
            peer[0] if isinstance(peer, tuple) else peer,
            verdict.cut,
        )
        # Its reads fail at once; the request tracker answers 408 and closes the connection.
        body.set_exception(BodyTimeoutError())
        self._body = None

    def linger(self) -> None:
        """The 408 of a cut body is written: half-close, drop what the client still sends,
        and close after ``LINGER_S``. Closing at once would answer the client's next bytes
        with a reset, which can destroy the 408 before the client reads it (RFC 9112 9.6)."""
        if self.transport is None:
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger = asyncio.get_running_loop().call_later(LINGER_S, self._linger_over)

    def _linger_over(self) -> None:
        self._linger = None
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, but not an asyncio.Transport instance on uvloop: no isinstance.
        transport = cast(asyncio.Transport, transport)
        open_ = self.connections.open
        if len(open_) >= self.connections.max_connections:
            self.connections.warnings.warn(
                "connection-limit",
                "connection limit reached (%d open): closing new connections",
                len(open_),
            )
            transport.abort()
            return
        self.transport = transport
        open_[self.handler] = self
        self.handler.connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        if self.body_cut is not None:
            return  # the rest of a cut body: the connection closes once 408 is sent
        # The first byte of a request on an idle kept-alive connection starts its deadline.
        if not self.busy:
            self.arm()
        self.handler.data_received(data)

    def eof_received(self) -> None:
        # None, as aiohttp's handler answers: the transport closes itself after a half-close.
        if self.transport is not None:
            self.handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        self.end_body()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self.transport is None:
            return
        self.transport = None
        self.connections.open.pop(self.handler, None)
        self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


def _request_tracker(connections: _Connections) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def track(request: web.Request, handler: Handler) -> web.StreamResponse:
        guard = connections.open.get(request.protocol)
        if guard is None:  # served outside a guarded site (aiohttp's test client)
            return await handler(request)
        guard.busy = True
        guard.disarm()
        if request.body_exists and not request.content.is_eof():
            guard.begin_body(request.content)
        try:
            response: web.StreamResponse | None = None
            try:
                response = await handler(request)
            except BodyTimeoutError:
                if guard.body_cut is None:
                    raise
            if guard.body_cut is not None:
                return await _answer_cut(request, response, guard.body_cut, guard)
            assert response is not None
            return response
        finally:
            guard.end_body()
            if guard.body_cut is not None:
                _release_cut_body(request.content)
            # Idle until the next request's first byte (data_received arms the deadline).
            guard.busy = False

    return track


def _release_cut_body(body: StreamReader) -> None:
    """Break the reference cycle a cut body leaves: the reader keeps the BodyTimeoutError it
    raised, whose traceback keeps the frames that awaited the reader (and through them the
    request, its handler and transport). Left alone, every cut connection's objects wait for
    the cyclic collector, and under a flood of slow bodies (hundreds of cuts a second) its
    full collections, which scan every open connection, paused the router for up to a second
    (bench/router_slow_bodies.py). Without the traceback, reference counting frees them."""
    error = body.exception()
    if error is not None:
        error.__traceback__ = None
        error.__context__ = None


async def _answer_cut(
    request: web.Request, response: web.StreamResponse | None, why: str, guard: _Guard
) -> web.StreamResponse:
    """The answer to a request whose body was cut: 408, then the connection closed - unless an
    answer was already under way, which ends with the connection."""
    if response is not None and response.prepared:
        response.force_close()
        return response
    answer = web.json_response(
        error_body(
            408,
            f"the request body did not arrive in time ({why}); send it at once, as JSON clients do",
        ),
        status=408,
        headers={"Connection": "close"},
    )
    # No more of the body reaches aiohttp (_Guard.data_received drops it): as far as aiohttp
    # knows the request is complete, so it neither lingers reading it nor closes at once. The
    # guard closes instead, once the client has had time to read the 408 (_Guard.linger).
    request.content.feed_eof()
    await answer.prepare(request)
    await answer.write_eof()
    guard.linger()
    return answer


def make_runner(
    app: web.Application, limits: ServerLimits = ServerLimits(), **kwargs: Any
) -> web.AppRunner:
    """An AppRunner whose connections are guarded by ``limits`` once served by
    :func:`start_site`. ``kwargs`` go to ``web.AppRunner`` (handler_cancellation, ...)."""
    warnings = _ThrottledWarnings(limits.warn_interval_s)
    connections = _Connections(limits, warnings)
    # Outermost: a request counts as started before any other middleware runs.
    app.middlewares.insert(0, _request_tracker(connections))
    app[_CONNECTIONS] = connections
    return web.AppRunner(
        app,
        keepalive_timeout=limits.keepalive_timeout_s,
        logger=_ServerLogger(warnings),
        **kwargs,
    )


# The connection table of an app served by make_runner, for the site that listens for it.
_CONNECTIONS: web.AppKey[_Connections] = web.AppKey("fleetpilot_connections", _Connections)


class GuardedSite(web.BaseSite):
    """A TCP listener whose connections go through :class:`_Guard` (limit, header timeout)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._connections = runner.app[_CONNECTIONS]

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        connections = self._connections

        def protocol() -> _Guard:
            return _Guard(server(), connections)

        self._server = await asyncio.get_running_loop().create_server(
            protocol, self._host, self._port, reuse_address=True
        )


def open_connections(app: web.Application) -> int:
    """Connections open now on the guarded site serving ``app`` (0 when not served)."""
    connections = app.get(_CONNECTIONS)
    return 0 if connections is None else len(connections.open)


async def start_site(runner: web.AppRunner, host: str, port: int) -> GuardedSite:
    """Set ``runner`` up (made by :func:`make_runner`) and listen on ``host:port``;
    :class:`~fleetpilot.listening.ListenError` when the address cannot be bound."""
    await runner.setup()
    site = GuardedSite(runner, host, port)
    with listening_on(host, port):
        await site.start()
    return site


def run_app(
    app: web.Application,
    host: str,
    port: int,
    limits: ServerLimits = ServerLimits(),
    shutdown_delay_s: float = 0.0,
    **kwargs: Any,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then shut down gracefully (on_cleanup runs).

    ``shutdown_delay_s``: after the signal, keep listening and serving that long before the
    listener closes. A pod that is deleted is taken out of its Service's EndpointSlices at
    the same moment it gets SIGTERM, and the clients, proxies and kube-proxies that route to
    it learn that a moment later: a listener closed at once refuses what they still send."""

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner = make_runner(app, limits, **kwargs)
        try:
            await start_site(runner, host, port)
            settle_heap()
            await stop.wait()
            if shutdown_delay_s > 0:
                log.info(
                    "stopping: still serving while clients learn of it",
                    extra={"seconds": shutdown_delay_s},
                )
                await asyncio.sleep(shutdown_delay_s)
        finally:
            await runner.cleanup()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(serve())


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The loop a server runs on: uvloop, as vLLM's API server does. Accepting a connection,
    reading a few bytes and timing it out cost a fraction of asyncio's there, and those are
    what thousands of slow clients make a listener do (``bench/router_slow_bodies.py``)."""
    return uvloop.new_event_loop()
