"""The router's HTTP server (aiohttp): the process's parts, started and stopped together, and
its routes (``fleetpilot router``, the command line, is ``routing.cli``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (proxied), ``GET /v1/models``
(the service name, which lets the router choose, and each tier's model alias), ``GET /health``,
``GET /metrics``. Every error is OpenAI-shaped JSON.

``/metrics`` names replicas (their addresses), tenants and what each tenant sent: with the
config's ``metricsPort`` it is served on a second listener of its own (``/metrics`` and
``/health`` only, the port a Kubernetes Service for clients does not expose) and the public
port answers 404 for it; without one, the public port serves it only while no API keys are
configured (:func:`metrics_on_public_port`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import aiohttp
import grpc
from aiohttp import web

from fleetpilot.api.router_config import RouterConfig
from fleetpilot.httpserver import make_runner, start_site
from fleetpilot.routing.auth import AuthGate, KeyRing, Tenant
from fleetpilot.routing.config import ConfigWatcher
from fleetpilot.routing.discovery import (
    FileSource,
    MergedSource,
)
from fleetpilot.routing.endpoints import EndpointSource, replica_of_stream
from fleetpilot.routing.epp.server import start_picker
from fleetpilot.routing.epp.tls import self_signed
from fleetpilot.routing.errors import (
    InvalidRequestError,
    RouterError,
    UnknownModelError,
)
from fleetpilot.routing.health import Prober
from fleetpilot.routing.kv_events_client import KVEventsClient
from fleetpilot.routing.metrics import CONTENT_TYPE, RouterMetrics
from fleetpilot.routing.peers import (
    PEER_COUNTS_PATH,
    Counts,
    PeerExchange,
    encode_counts,
    new_router_id,
)
from fleetpilot.routing.policies.kv_index import KVIndex
from fleetpilot.routing.proxy import Proxy, error_response
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.router import Router
from fleetpilot.routing.scrape import Scraper
from fleetpilot.routing.tasks import cancel
from fleetpilot.routing.tokenizer.errors import TokenizerError
from fleetpilot.routing.tokenizer.request import load_tokenizer

log = logging.getLogger("fleetpilot.routing")

# A tokenizer that failed to load (the Hub unreachable, a file missing) is tried again this
# often; meanwhile its tier routes on the guessed index.
TOKENIZER_RETRY_S = 30.0

STARTED = int(time.time())


def metrics_on_public_port(*, auth_on: bool, metrics_listener: bool) -> bool:
    """Whether the public port answers ``GET /metrics``: only when no metrics listener of its
    own serves it and no API keys guard the fleet - with keys on, the exposition's replica
    addresses, tenant names and per-tenant counts are not for any client that can reach the
    router. Purely computational."""
    return not auth_on and not metrics_listener


class RouterApp:
    """Everything one router process runs: the decisions, the proxy, and the background loops
    (scraping, probing, config and endpoint reloads)."""

    def __init__(
        self,
        config: RouterConfig,
        source: EndpointSource,
        *,
        config_path: Path | None = None,
        reload_interval_s: float = 1.0,
        seed: int | None = None,
        debug_route_header: bool = False,
    ) -> None:
        self.metrics = RouterMetrics()
        self.debug_route_header = debug_route_header
        self.source = source
        self.kv_index = KVIndex()
        self.kv_events: KVEventsClient | None = None
        self.tokenizer_refs: dict[str, str] = {}  # tier -> the ref its tokenizer came from
        self._tokenizer_task: asyncio.Task[None] | None = None
        self.router = Router(
            config,
            source,
            rng=random.Random(seed),
            on_eject=self._ejected,
            kv_index=self.kv_index,
            kv_live=self._kv_live,
            on_replicas=self._follow_replicas,
        )
        # API keys (routing.auth): checked before any routing work; re-read as they change.
        self.auth = AuthGate(
            config.auth,
            on_reload=self._keys_loaded,
            on_result=lambda r: self.metrics.file_reloads.labels("auth_keys", r).inc(),
        )
        for part in source.sources if isinstance(source, MergedSource) else [source]:
            if isinstance(part, FileSource):
                part.on_result = lambda r: self.metrics.file_reloads.labels("endpoints", r).inc()
        self.config_path = config_path
        self.reload_interval_s = reload_interval_s
        self.session: aiohttp.ClientSession | None = None
        self.proxy: Proxy | None = None
        self.watcher: ConfigWatcher | None = None
        self.scraper: Scraper | None = None
        self.prober: Prober | None = None
        # The metrics listener (config.metricsPort), when one runs: bound once, at start.
        self.metrics_runner: web.AppRunner | None = None
        self.metrics_port: int | None = None
        self.epp_server: grpc.aio.Server | None = None  # the endpoint picker (eppPort)
        # Its id among the router replicas that share their counts (``routing.peers``).
        self.router_id = new_router_id()
        self.peers: PeerExchange | None = None

    def _ejected(self, replica: ReplicaState) -> None:
        # Every ejection, whether a request or a /metrics scrape found the failure.
        self.metrics.ejections.labels(replica.endpoint.tier, replica.id).inc()

    def _kv_live(self, stream: str) -> bool:
        return self.kv_events is not None and self.kv_events.has_events(stream)

    def _follow_replicas(self, replicas: Mapping[str, ReplicaState]) -> None:
        """Subscribe to the KV events of exactly the replicas discovery lists now."""
        if self.kv_events is not None:
            self.kv_events.set_endpoints(
                {
                    stream: publisher
                    for r in replicas.values()
                    for stream, publisher in r.endpoint.kv_streams().items()
                }
            )

    def _keys_loaded(self, ring: KeyRing) -> None:
        self.metrics.auth_keys.clear()
        for tenant, count in ring.key_counts().items():
            self.metrics.auth_keys.labels(tenant).set(count)

    def apply_config(self, config: RouterConfig) -> None:
        if config.metrics_port != self.metrics_port:
            log.warning(
                "metricsPort changed; the metrics listener keeps its port until a restart",
                extra={"metrics_port": self.metrics_port, "configured": config.metrics_port},
            )
        self.auth.apply(config.auth)
        self.router.apply_config(config)
        self._retune_loops(config)
        self._follow_tokenizers(config)

    def _follow_tokenizers(self, config: RouterConfig) -> None:
        """Drop tokenizers of tiers that left or changed their ref; load the missing ones."""
        wanted = {t.name: t.tokenizer for t in config.tiers if t.tokenizer is not None}
        for tier in [t for t, ref in self.tokenizer_refs.items() if wanted.get(t) != ref]:
            del self.tokenizer_refs[tier]
            self.router.tokenizers.pop(tier, None)
            if tier in wanted:  # its ref changed: the new one loads below
                self.metrics.tokenizer_loaded.labels(tier).set(0)
            else:
                self.metrics.tokenizer_loaded.remove(tier)
        if self._tokenizer_task is not None:
            self._tokenizer_task.cancel()
            self._tokenizer_task = None
        missing = {t: ref for t, ref in wanted.items() if t not in self.tokenizer_refs}
        for tier in missing:
            self.metrics.tokenizer_loaded.labels(tier).set(0)
        if missing and self.session is not None:  # started: a running loop
            self._tokenizer_task = asyncio.create_task(
                self._load_tokenizers(missing), name="tokenizers"
            )

    async def _load_tokenizers(self, missing: dict[str, str]) -> None:
        """Load each tier's tokenizer off the loop (a Hub download can take seconds), retrying
        failures; until one is loaded its tier routes on the guessed index."""
        while missing:
            for tier, ref in list(missing.items()):
                try:
                    tokenizer = await asyncio.to_thread(load_tokenizer, ref)
                except TokenizerError as exc:
                    log.warning(
                        "tokenizer unavailable; routing on the guessed index",
                        extra={"tier": tier, "tokenizer": ref, "err": str(exc)},
                    )
                    continue
                self.router.tokenizers[tier] = tokenizer
                self.tokenizer_refs[tier] = ref
                self.metrics.tokenizer_loaded.labels(tier).set(1)
                del missing[tier]
                log.info("tokenizer loaded", extra={"tier": tier, "tokenizer": ref})
            if missing:
                await asyncio.sleep(TOKENIZER_RETRY_S)

    def _retune_loops(self, config: RouterConfig) -> None:
        if self.scraper is not None:
            self.scraper.interval_s = config.scrape.interval.total_seconds()
            self.scraper.timeout_s = config.scrape.timeout.total_seconds()
        if self.prober is not None:
            self.prober.interval_s = config.ejection.probe_interval.total_seconds()
            self.prober.timeout_s = config.connect_timeout.total_seconds()

    async def start(self) -> None:
        config = self.router.config
        # The traffic pool: no connection limit (backpressure is the router's own, by queue
        # length and in-flight count, where it can answer 429 rather than wait silently), and
        # keep-alive so each request reuses a warm connection.
        # No cookie jar: engines set no cookies, and filtering the jar costs per request.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self.proxy = Proxy(
            self.router,
            self.metrics,
            self.session,
            debug_route_header=self.debug_route_header,
            auth=self.auth,
        )
        await self.auth.start()
        self.kv_events = KVEventsClient(
            self.kv_index,
            self.metrics,
            on_stored=lambda stream, keys: self.router.recent.confirm(
                replica_of_stream(stream), keys
            ),
        )
        await self.source.start()
        self.router.sync()
        self._follow_replicas({r.id: r for r in self.router.replicas()})
        self._follow_tokenizers(config)
        self.scraper = Scraper(
            self.router,
            self.metrics,
            interval_s=config.scrape.interval.total_seconds(),
            timeout_s=config.scrape.timeout.total_seconds(),
        )
        await self.scraper.start()
        self.prober = Prober(
            self.router,
            self.metrics,
            interval_s=config.ejection.probe_interval.total_seconds(),
            timeout_s=config.connect_timeout.total_seconds(),
        )
        await self.prober.start()
        self.peers = PeerExchange(
            self.router, self.metrics, self.router_id, self.auth.limiter, self.proxy.admission
        )
        await self.peers.start()
        if self.config_path is not None:
            self.watcher = ConfigWatcher(
                self.config_path,
                self.apply_config,
                interval_s=self.reload_interval_s,
                on_result=lambda r: self.metrics.config_reloads.labels(r).inc(),
            )
            await self.watcher.start()
        log.info(
            "router started",
            extra={
                "tiers": [t.name for t in config.tiers],
                "endpoints": len(self.router.replicas()),
            },
        )

    async def start_metrics_listener(self, host: str) -> None:
        """Serve ``/metrics`` and ``/health`` on the config's ``metricsPort`` (nothing without
        one), with the same listener guards as the public port."""
        port = self.router.config.metrics_port
        if port is None:
            if self.router.config.auth is not None:
                log.warning(
                    "API keys are on and no metricsPort is set: /metrics is served on no port "
                    "(set metricsPort to scrape the router)"
                )
            return
        app = web.Application(middlewares=[openai_errors])
        app.router.add_get("/metrics", self.metrics_exposition)
        app.router.add_get("/health", self.health)
        app.router.add_get(PEER_COUNTS_PATH, self.peer_counts)
        runner = make_runner(app, access_log=None)
        try:
            # A bind failure leaves as ListenError naming this (the metrics) address.
            await start_site(runner, host, port)
        except OSError:
            await runner.cleanup()
            raise
        self.metrics_runner = runner
        self.metrics_port = port
        log.info("metrics listener started", extra={"host": host, "port": port})

    async def start_epp(self, host: str) -> None:
        """Serve the endpoint picker (``routing.epp``) and gRPC health on the config's
        ``eppPort`` (nothing without one), over this router's proxy: one decision path."""
        port = self.router.config.epp_port
        if port is None:
            return
        assert self.proxy is not None, "start() first"
        # Made off the loop: a key pair costs a few milliseconds of CPU.
        identity = await asyncio.to_thread(self_signed) if self.router.config.epp_tls else None
        self.epp_server = await start_picker(self.proxy, host, port, identity=identity)
        log.info("endpoint picker started", extra={"host": host, "port": port})

    async def stop(self) -> None:
        if self.epp_server is not None:
            # Streams in flight end now: their requests' counts are given back as they close.
            await self.epp_server.stop(grace=None)
            self.epp_server = None
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()
            self.metrics_runner = None
        await self.auth.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.prober is not None:
            await self.prober.stop()
        if self.peers is not None:
            await self.peers.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        await cancel(self._tokenizer_task)
        self._tokenizer_task = None
        if self.kv_events is not None:
            await self.kv_events.stop()
            self.kv_events = None
        await self.source.stop()
        if self.proxy is not None:
            self.proxy.close()
        if self.session is not None:
            await self.session.close()
            self.session = None

    # -- handlers ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self.proxy is not None
        return await self.proxy.handle(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        assert self.proxy is not None
        return await self.proxy.handle(request, "chat")

    async def models(self, request: web.Request) -> web.Response:
        """The models a client may request: with API keys, only its tenant's tiers and
        adapters (and a request without a valid key is refused, as on the other routes)."""
        config = self.router.config
        tenant: Tenant | None = None
        ring = self.auth.ring
        if ring is not None:
            try:
                tenant = ring.authenticate(request.headers.get("Authorization"))
            except RouterError as exc:
                self.metrics.rejected.labels(str(exc.status), exc.reason or "").inc()
                return error_response(exc)
        tiers = self.router.tiers
        if tenant is not None and tenant.allowed_tiers is not None:
            tiers = [t for t in tiers if t.name in tenant.allowed_tiers]
        adapters = [
            (t, adapter)
            for t in tiers
            for adapter in t.adapters
            if tenant is None or tenant.allowed_adapters is None
            or adapter in tenant.allowed_adapters
        ]  # fmt: skip
        entries = [
            {
                "id": config.service,
                "object": "model",
                "created": STARTED,
                "owned_by": "fleetpilot",
                "root": config.service,
                "parent": None,
            }
        ]
        entries += [
            {
                "id": t.model,
                "object": "model",
                "created": STARTED,
                "owned_by": "fleetpilot",
                "root": t.model,
                "parent": None,
            }
            for t in tiers
        ]
        # Adapters as vLLM lists them: their parent is the base model they adapt.
        entries += [
            {
                "id": adapter,
                "object": "model",
                "created": STARTED,
                "owned_by": "fleetpilot",
                "root": adapter,
                "parent": t.model,
            }
            for t, adapter in adapters
        ]
        return web.json_response({"object": "list", "data": entries})

    async def health(self, request: web.Request) -> web.Response:
        replicas = self.router.replicas()
        ejected = set(self.router.health.ejected())
        return web.json_response(
            {"status": "ok", "endpoints": len(replicas), "ejected": len(ejected)}
        )

    async def peer_counts(self, request: web.Request) -> web.Response:
        """This router's requests at each replica, for its peers (``routing.peers``)."""
        now = self.router.clock()
        counts = (
            (r.id, Counts(r.in_flight, r.pending_prefill, r.recent_sends(now, own=True)))
            for r in self.router.replicas()
        )
        spent = self.auth.limiter.spent()
        flows = self.proxy.admission.flows() if self.proxy is not None else {}
        return web.json_response(encode_counts(self.router_id, counts, spent, flows))

    async def peer_counts_view(self, request: web.Request) -> web.Response:
        """``GET /fleetpilot/peer-counts`` on the public port: served where ``/metrics`` is
        (it names replicas), else a 404."""
        refused = self._not_on_public_port(request.path)
        return refused if refused is not None else await self.peer_counts(request)

    def _not_on_public_port(self, path: str) -> web.Response | None:
        """A 404 for ``path`` on the public port unless that port serves the metrics
        (:func:`metrics_on_public_port`)."""
        listener = self.metrics_runner is not None
        if metrics_on_public_port(
            auth_on=self.router.config.auth is not None, metrics_listener=listener
        ):
            return None
        where = "its metrics port" if listener else "no port while API keys are on"
        return error_response(
            UnknownModelError(
                f"no route for GET {path} on this port: the router serves it on {where}",
                reason="not_found",
            )
        )

    async def metrics_view(self, request: web.Request) -> web.Response:
        """``GET /metrics`` on the public port: the exposition where that port serves it
        (:func:`metrics_on_public_port`), else a 404 as for any unknown route."""
        refused = self._not_on_public_port(request.path)
        return refused if refused is not None else await self.metrics_exposition(request)

    async def metrics_exposition(self, request: web.Request) -> web.Response:
        self._update_endpoint_gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def _update_endpoint_gauges(self) -> None:
        counts: dict[tuple[str, str, str], int] = {}
        for tier in self.router.config.tiers:
            for group in tier.endpoints:
                for state in ("active", "ejected"):
                    counts[(tier.name, group.role, state)] = 0
        for r in self.router.replicas():
            state = "ejected" if self.router.health.is_ejected(r.id) else "active"
            key = (r.endpoint.tier, r.endpoint.role, state)
            counts[key] = counts.get(key, 0) + 1
        self.metrics.endpoints.clear()
        for (tier_name, role, state), n in counts.items():
            self.metrics.endpoints.labels(tier_name, role, state).set(n)
        requests = self.metrics.replica_requests
        requests.clear()
        for r in self.router.replicas():
            requests.labels(r.id, "self").set(r.in_flight)
            requests.labels(r.id, "peers").set(r.peer_in_flight)


ROUTER_APP: web.AppKey[RouterApp] = web.AppKey("router_app", RouterApp)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 404/405/413 and anything unexpected, as OpenAI-shaped JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error: RouterError
        if exc.status == 404:
            error = UnknownModelError(
                f"no route for {request.method} {request.path}", reason="not_found"
            )
        else:
            error = InvalidRequestError(exc.reason, reason=exc.reason.lower().replace(" ", "_"))
        error.status = exc.status
        return error_response(error)
    except RouterError as exc:
        return error_response(exc)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unexpected error", extra={"path": request.path})
        return error_response(RouterError("internal router error", status=500))


def build_app(
    config: RouterConfig,
    source: EndpointSource,
    *,
    config_path: Path | None = None,
    reload_interval_s: float = 1.0,
    seed: int | None = None,
    debug_route_header: bool = False,
    metrics_host: str = "127.0.0.1",
) -> web.Application:
    """The aiohttp application; run it with ``handler_cancellation=True`` so a client that
    disconnects cancels its upstream request. The metrics listener (the config's
    ``metricsPort``) listens on ``metrics_host``: the public listener's address."""
    state = RouterApp(
        config,
        source,
        config_path=config_path,
        reload_interval_s=reload_interval_s,
        seed=seed,
        debug_route_header=debug_route_header,
    )
    # client_max_size: the proxy enforces the config's max_body_bytes itself (it can change on
    # reload); aiohttp's own 1 MiB default must not refuse bodies first.
    app = web.Application(middlewares=[openai_errors], client_max_size=1 << 62)
    app[ROUTER_APP] = state
    app.router.add_post("/v1/completions", state.completions)
    app.router.add_post("/v1/chat/completions", state.chat)
    app.router.add_get("/v1/models", state.models)
    app.router.add_get("/health", state.health)
    app.router.add_get("/metrics", state.metrics_view)
    app.router.add_get(PEER_COUNTS_PATH, state.peer_counts_view)

    async def on_startup(_: web.Application) -> None:
        await state.start_metrics_listener(metrics_host)
        await state.start()
        await state.start_epp(metrics_host)

    async def on_cleanup(_: web.Application) -> None:
        await state.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
