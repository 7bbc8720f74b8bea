"""Admission: whether a request may be routed now, and when it may not, how it waits.

One :class:`Admission` per router replica owns what decides that: the per-client count of
unfinished requests (``backpressure.maxUnfinishedPerClient``), the router-wide count of requests
whose body arrived (``backpressure.maxInFlight``), the fair queue and its waiters
(``routing.flow``), each tier's requests in flight per tenant with the tenants active there
(its own, and its peer routers' as the peer exchange last reported them: ``routing.peers``),
and the cold-start hold of a request whose tier is at zero (``routing.hold``).

It asks the router only which tier a request would wait for and how many batch slots a tier
has, and gets its routes from the "route now" function it is given; it never touches a
replica. It does no I/O: waiting is asyncio's, and time is the clock it is given (monotonic
seconds), so a test can drive the window in which a tenant counts as active.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, Protocol, TypeVar

from fleetpilot.api.router_config import FlowConfig, RouterConfig, RouterTier
from fleetpilot.routing.errors import NoReplicaError, OverloadedError
from fleetpilot.routing.flow import FairQueue, QueueFullError, Ticket, may_start
from fleetpilot.routing.hold import ColdStartHold
from fleetpilot.routing.limits import client_may_start
from fleetpilot.routing.route import Resolved

# How often a held request (its tier at zero replicas) looks for a replica again: an engine
# takes seconds to start, so a quarter second adds little and costs nothing.
COLD_START_POLL_S = 0.25
# How often the head of the fair queue tries again while no request ends (capacity also frees
# when a scrape shows an engine's batch emptier than the router thought).
FLOW_POLL_S = 0.05
# A tenant that sent a request within this long is active on its tier (it keeps its headroom
# there: routing.flow) even while nothing of its is in flight or queued.
ACTIVE_WINDOW_S = 10.0


class Client(Protocol):
    """The tenant of a request (``auth.Tenant``), as admission sees it."""

    @property
    def name(self) -> str: ...
    @property
    def weight(self) -> float: ...
    @property
    def priority(self) -> int: ...


class Routed(Protocol):
    """A route (``router.Route``), as admission sees it: which tier's slots it takes."""

    @property
    def tier(self) -> RouterTier: ...


class AdmissionRouter(Protocol):
    """What admission asks of the router."""

    @property
    def config(self) -> RouterConfig: ...
    def waiting_tier(self, resolved: Resolved) -> RouterTier: ...
    def batch_slots(self, tier_name: str) -> int: ...


class _Gauge(Protocol):
    def inc(self, amount: float = 1) -> None: ...
    def dec(self, amount: float = 1) -> None: ...


class _Gauges(Protocol):
    def labels(self, *values: str) -> _Gauge: ...


class _Histogram(Protocol):
    def observe(self, amount: float) -> None: ...


class _Histograms(Protocol):
    def labels(self, *values: str) -> _Histogram: ...


class AdmissionMetrics(Protocol):
    """The metrics admission keeps (``metrics.RouterMetrics``)."""

    @property
    def in_flight(self) -> _Gauge: ...
    @property
    def unfinished(self) -> _Gauge: ...
    @property
    def pending(self) -> _Gauges: ...
    @property
    def queued(self) -> _Gauges: ...
    @property
    def queue_wait_seconds(self) -> _Histograms: ...


R = TypeVar("R", bound=Routed)


@dataclass
class Entry:
    """One request's standing in admission."""

    # Whose key the request carries; None without auth (no fair turns, no tenant headroom).
    tenant: Client | None = None
    in_flight: bool = False  # counted against backpressure.maxInFlight (its body arrived)
    # The tier whose batch slots count this request as its tenant's (routing.flow).
    flight_tier: str | None = None
    # While the request is held for a tier at zero: the hold, and when it began (the clock's);
    # the request timeout ending it answers as the hold running out does.
    hold: ColdStartHold | None = None
    held_since: float = 0.0


class Admission(Generic[R]):
    """The admission state of one router replica; ``route`` routes a request now (raising
    ``NoReplicaError`` or ``OverloadedError`` when it cannot)."""

    def __init__(
        self,
        router: AdmissionRouter,
        metrics: AdmissionMetrics,
        route: Callable[[Resolved], Awaitable[R]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.route = route
        self.clock = clock
        # Requests waiting for capacity (routing.flow), and how to wake each.
        self.queue = FairQueue(max_queued=1)
        self._waiters: dict[int, asyncio.Event] = {}
        # Per tier, each tenant's requests in flight, when it last sent one, and its weight:
        # who is active there, and what each holds (flow.may_start).
        self._flight: dict[str, dict[str, int]] = {}
        self._seen: dict[tuple[str, str], float] = {}
        self._weights: dict[str, float] = {}
        # The same per tier for the peer routers, summed (``set_peer_flows``): the tenants
        # active at any of them, and what each has in flight there. With several router
        # replicas each sees only its share of a tenant's requests, and a heavy tenant's share
        # at every router would pass the headroom rule while together they fill every slot.
        self._peer_flight: dict[str, dict[str, int]] = {}
        self.in_flight = 0
        # Per client (tenant, or source address without keys): requests from their headers
        # to their end, bodies still arriving included (backpressure.maxUnfinishedPerClient).
        self._unfinished: dict[str, int] = {}

    # -- counts ------------------------------------------------------------------------------
    def open_client(self, client: str) -> None:
        """Count a request of ``client`` from its headers on, or 429 at the client's limit."""
        unfinished = self._unfinished.get(client, 0)
        if not client_may_start(unfinished, self.router.config.backpressure.per_client_cap()):
            raise OverloadedError(
                f"this client has {unfinished} unfinished requests, its limit on this "
                "router; retry when one has ended",
                reason="client_overloaded",
                headers={"Retry-After": self.retry_after()},
            )
        self._unfinished[client] = unfinished + 1
        self.metrics.unfinished.inc()

    def close_client(self, client: str) -> None:
        self.metrics.unfinished.dec()
        left = self._unfinished[client] - 1
        if left:
            self._unfinished[client] = left
        else:
            del self._unfinished[client]

    def take_in_flight(self, entry: Entry) -> None:
        """Count a request whose body arrived against ``maxInFlight``, or 429 at it."""
        if self.in_flight >= self.router.config.backpressure.max_in_flight:
            raise OverloadedError(
                "the router is at its in-flight limit; retry later",
                reason="overloaded",
                headers={"Retry-After": self.retry_after()},
            )
        entry.in_flight = True
        self.in_flight += 1
        self.metrics.in_flight.inc()

    def finish(self, entry: Entry) -> None:
        """The request ended: its counts back, and the next waiting one may fit now."""
        if entry.in_flight:
            entry.in_flight = False
            self.in_flight -= 1
            self.metrics.in_flight.dec()
        if entry.flight_tier is not None:
            assert entry.tenant is not None
            self._flight[entry.flight_tier][entry.tenant.name] -= 1
            entry.flight_tier = None
        self._wake_head()

    def hold_refusal(self, entry: Entry) -> NoReplicaError | None:
        """The 503 of a request still held when its own timeout ended it, if it is held."""
        if entry.hold is None:
            return None
        return entry.hold.refusal(self.clock() - entry.held_since)

    def retry_after(self) -> str:
        return str(max(1, round(self.router.config.backpressure.retry_after.total_seconds())))

    # -- the decision ------------------------------------------------------------------------
    async def decide(self, resolved: Resolved, entry: Entry) -> R:
        """The route, counted on its tier for the tenant. While no tier in reach has a
        replica, the request is held for a cold start (``_hold``); while every replica in
        reach is saturated, it waits in the fair queue when the config has one
        (``_wait_for_capacity``), else 429."""
        flow = self.router.config.flow
        tenant = entry.tenant
        waiting: RouterTier | None = None  # the tier it would wait for, once known
        route: R
        if flow is not None and tenant is not None and flow.headroom > 0:
            waiting = self.router.waiting_tier(resolved)
            self._seen[(waiting.name, tenant.name)] = self.clock()
            self._weights[tenant.name] = tenant.weight
            if not self._may_start(tenant.name, waiting.name):
                # Its share is taken and others keep slots free: wait for one of its own.
                return await self._wait_for_capacity(resolved, entry, flow, waiting)
        if flow is not None and len(self.queue):
            # Others wait for capacity already: behind them (or ahead, by class and turn).
            return await self._wait_for_capacity(resolved, entry, flow, waiting)
        try:
            route = await self.route(resolved)
        except NoReplicaError as exc:
            if self.router.config.cold_start_wait <= timedelta(0):
                raise
            route = await self._hold(resolved, entry, exc)
        except OverloadedError:
            if flow is None:
                raise
            return await self._wait_for_capacity(resolved, entry, flow, waiting)
        self._start_flight(entry, route.tier.name)
        return route

    async def _hold(self, resolved: Resolved, entry: Entry, missing: NoReplicaError) -> R:
        """No tier in reach has a replica: the request is held (counted as pending for its
        tier's roles, which the autoscaler scales from zero on) for the tier's observed cold
        start and a margin, at most the config's ``cold_start_wait``
        (``hold.ColdStartHold``), then refused with 503 and Retry-After."""
        hold = ColdStartHold.of(self.router.config, missing.tier, missing.roles)
        pending = [self.metrics.pending.labels(hold.tier, role) for role in hold.roles]
        for gauge in pending:
            gauge.inc()
        entry.hold, entry.held_since = hold, self.clock()
        deadline = entry.held_since + hold.seconds
        try:
            while True:
                await asyncio.sleep(min(COLD_START_POLL_S, max(0.0, deadline - self.clock())))
                try:
                    route = await self.route(resolved)
                except NoReplicaError:
                    now = self.clock()
                    if now >= deadline:
                        raise hold.refusal(now - entry.held_since) from None
                else:
                    entry.hold = None
                    return route
        finally:
            for gauge in pending:
                gauge.dec()

    async def _wait_for_capacity(
        self,
        resolved: Resolved,
        entry: Entry,
        flow: FlowConfig,
        tier: RouterTier | None = None,
    ) -> R:
        """Every replica in the request's reach is saturated: wait in the fair queue
        (routing.flow) until the request is the next to go and a replica has room, at most
        ``flow.max_wait``; 429 past it, or when shed from a full queue. While it waits the
        request counts as pending for its tier's roles, which the autoscaler scales on."""
        tenant = entry.tenant
        name = tenant.name if tenant is not None else ""
        self.queue.max_queued = flow.max_queued
        deadline = self.clock() + flow.max_wait.total_seconds()
        if tier is None:
            tier = self.router.waiting_tier(resolved)
        try:
            ticket, shed = self.queue.enqueue(
                name,
                tenant.weight if tenant is not None else 1.0,
                tenant.priority if tenant is not None else 0,
                deadline,
                tier.name,
            )
        except QueueFullError:
            raise self._queue_refusal("the router's queue is full", "queue_full") from None
        if shed is not None:
            self._wake(shed)  # it finds itself gone and answers 429
        key = id(ticket)
        woken = self._waiters[key] = asyncio.Event()
        pending = [self.metrics.pending.labels(tier.name, g.role) for g in tier.endpoints]
        for gauge in pending:
            gauge.inc()
        self.metrics.queued.labels(name).inc()
        waited = self.clock()
        try:
            self._wake_head()
            route = await self._wait_turn(resolved, ticket, woken, deadline, flow)
            # Counted before the next is woken, which judges its turn by these counts.
            self._start_flight(entry, route.tier.name)
            self.metrics.queue_wait_seconds.labels(name).observe(self.clock() - waited)
            self._wake_head()  # the next may fit too
            return route
        finally:
            self.queue.remove(ticket)
            del self._waiters[key]
            for gauge in pending:
                gauge.dec()
            self.metrics.queued.labels(name).dec()
            self._wake_head()

    async def _wait_turn(
        self,
        resolved: Resolved,
        ticket: Ticket,
        woken: asyncio.Event,
        deadline: float,
        flow: FlowConfig,
    ) -> R:
        """Wait until ``ticket`` is the next to go and routing it finds room; it leaves the
        queue with its route."""
        while True:
            left = deadline - self.clock()
            if left <= 0:
                raise self._queue_refusal(
                    f"no replica had room within {flow.max_wait.total_seconds():g} s",
                    "queue_timeout",
                )
            is_head = self._next() is ticket
            with contextlib.suppress(TimeoutError):
                # The head polls (capacity also frees as scrapes come in); the others
                # wait to be woken, or for their deadline.
                await asyncio.wait_for(woken.wait(), min(left, FLOW_POLL_S) if is_head else left)
            woken.clear()
            if ticket not in self.queue:
                raise self._queue_refusal("shed for a request of a higher class", "shed")
            if self._next() is not ticket:
                # Woken, but another goes next now (the counts moved since): pass the
                # wake-up on, or that one would wait for its deadline.
                self._wake_head()
                continue
            try:
                route = await self.route(resolved)
            except OverloadedError:
                continue
            self.queue.dispatch(ticket)
            return route

    # -- turns -------------------------------------------------------------------------------
    def _wake(self, ticket: Ticket) -> None:
        woken = self._waiters.get(id(ticket))
        if woken is not None:
            woken.set()

    def _wake_head(self) -> None:
        head = self._next()
        if head is not None:
            self._wake(head)

    def _next(self) -> Ticket | None:
        """The waiting request that goes next: the first in turn whose tenant may start one
        more on its tier now (``flow.may_start``)."""
        if not len(self.queue):
            return None
        flow = self.router.config.flow
        if flow is None or flow.headroom <= 0:
            return self.queue.head()
        verdicts: dict[tuple[str, str], bool] = {}

        def eligible(ticket: Ticket) -> bool:
            key = (ticket.tier, ticket.tenant)
            verdict = verdicts.get(key)
            if verdict is None:
                verdict = verdicts[key] = self._may_start(ticket.tenant, ticket.tier)
            return verdict

        return self.queue.head(eligible)

    def _may_start(self, tenant: str, tier: str) -> bool:
        """Whether ``tenant`` may start one more request on ``tier`` now, the other tenants
        active there - at this router or a peer - keeping their headroom (``flow.may_start``)."""
        flow = self.router.config.flow
        if flow is None or flow.headroom <= 0 or not tenant:
            return True
        flight = self._flight.get(tier, {})
        active = self._active(tier)
        peers = self._peer_flight.get(tier)
        if peers:
            active.update(peers)
            flight = {t: flight.get(t, 0) + peers.get(t, 0) for t in active}
        active.add(tenant)
        if len(active) < 2:
            return True
        weights = {t: self._weight(t) for t in active}
        return may_start(tenant, weights, flight, self.router.batch_slots(tier), flow.headroom)

    def _active(self, tier: str) -> set[str]:
        """The tenants active on ``tier`` at this router: in flight, or seen lately."""
        since = self.clock() - ACTIVE_WINDOW_S
        active = {t for t, n in self._flight.get(tier, {}).items() if n > 0}
        active.update(t for (tr, t), at in self._seen.items() if tr == tier and at >= since)
        return active

    def active_tenants(self, tier: str) -> set[str]:
        """The tenants active on ``tier`` at this router or a peer (who keeps headroom)."""
        return self._active(tier) | set(self._peer_flight.get(tier, {}))

    def _weight(self, tenant: str) -> float:
        """A tenant's flow weight: as its last request here carried it, else as the keys
        config gives it (a tenant only a peer has seen)."""
        weight = self._weights.get(tenant)
        if weight is not None:
            return weight
        auth = self.router.config.auth
        for spec in auth.tenants if auth is not None else ():
            if spec.name == tenant:
                return spec.weight
        return 1.0

    # -- the peer routers --------------------------------------------------------------------
    def flows(self) -> dict[str, dict[str, int]]:
        """Per tier, this router's active tenants and their requests in flight there (0:
        active, nothing in flight): what it tells its peers."""
        tiers = set(self._flight) | {tier for tier, _ in self._seen}
        out: dict[str, dict[str, int]] = {}
        for tier in tiers:
            flight = self._flight.get(tier, {})
            active = self._active(tier)
            if active:
                out[tier] = {t: flight.get(t, 0) for t in sorted(active)}
        return out

    def set_peer_flows(self, flows: dict[str, dict[str, int]]) -> None:
        """The live peers' ``flows`` summed (the peer exchange is the one writer). A change
        may let a waiting request start (a peer's request ended): the next in turn is woken."""
        if flows == self._peer_flight:
            return
        self._peer_flight = flows
        self._wake_head()

    def _start_flight(self, entry: Entry, tier: str) -> None:
        """Count the request as its tenant's on ``tier`` (once)."""
        if entry.tenant is None or self.router.config.flow is None or entry.flight_tier is not None:
            return
        entry.flight_tier = tier
        flight = self._flight.setdefault(tier, {})
        flight[entry.tenant.name] = flight.get(entry.tenant.name, 0) + 1

    def _queue_refusal(self, why: str, reason: str) -> OverloadedError:
        return OverloadedError(
            f"every replica that could serve this request is at capacity and {why}; retry later",
            reason=reason,
            headers={"Retry-After": self.retry_after()},
        )
