"""Router replicas telling each other what they have in flight at each engine (issue 44).

A router counts exactly the requests it sent to each replica and has not finished
(``in_flight``) and the prompt blocks of those still waiting for a first token
(``pending_prefill``); its fair queue counts each tier's requests in flight per tenant and the
tenants active there (``admission``), and its tenant limits what each tenant spent. With
several router replicas - the chart runs two - each saw only its own share: two routers
sending a hot tenant to the replica that caches it each saw half its queue, so neither spread
it (bench/router_kv_events.py, the cluster trace: two router processes doubled TTFT p95
against one). The engines' scraped gauges see every client but
are a scrape interval old.

So each router serves its own counts (``GET /fleetpilot/peer-counts``, on the metrics
listener: it names replicas) and reads every peer's once per ``peers.interval``; a replica's
view adds the peers' counts to its own. Peers are the config's static addresses and, in a
cluster, the addresses the routers' headless Service resolves to (this router among them: it
knows itself by the id it serves). Directly, not through a shared store: two routers' counts
move every request, the exchange is one small GET per peer per interval, and nothing else
must run or be reachable for routing to work.

A peer that misses ``STALE_ROUNDS`` asks in a row is dropped: its counts stop counting,
which is the routers' behaviour before this exchange (each alone), and
``fleetpilot_router_peers{state="lost"}`` says so.

What is shared and what stays each router's own: the counts above are summed, so every
router's picks, fair-queue headroom (``flow.may_start``: a heavy tenant's requests at every
router together, against every slot) and tenant buckets see the whole fleet's; the fair
queue's turns (its virtual tags) are each router's, over the requests waiting there.

``PeerBook`` is the pure part; ``PeerExchange`` does the I/O.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from fleetpilot.api.router_config import Peers
from fleetpilot.routing.tasks import ReplicaRounds

if TYPE_CHECKING:
    from fleetpilot.routing.admission import Admission
    from fleetpilot.routing.limits import Limiter
    from fleetpilot.routing.metrics import RouterMetrics
    from fleetpilot.routing.router import Router

log = logging.getLogger(__name__)

PEER_COUNTS_PATH = "/fleetpilot/peer-counts"
# A peer's counts stop counting once it has missed this many asks in a row: one lost answer
# is noise, three in a row is a router gone (or partitioned away).
STALE_ROUNDS = 3
# How often the headless Service's addresses are resolved again (router pods come and go at
# the pace of a rollout, not of requests).
RESOLVE_S = 2.0
# Bounds on what a peer's answer may hold, so a confused or hostile peer cannot make this
# router allocate without limit.
MAX_REPLICAS = 100_000
MAX_ANSWER_BYTES = 8 << 20
# Without peers configured the exchange only checks, this often, whether a reload added some.
IDLE_INTERVAL_S = 1.0


def new_router_id() -> str:
    """This router process's id in the exchange: random, so a restarted pod is a new peer."""
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class Counts:
    """One router's requests at one replica: in flight, and prompt blocks awaiting a first
    token."""

    in_flight: int = 0
    pending_prefill: float = 0.0
    # Prefills it sent there lately (``ReplicaState.recent_sends``).
    recent_sends: float = 0.0

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.in_flight + other.in_flight,
            self.pending_prefill + other.pending_prefill,
            self.recent_sends + other.recent_sends,
        )


@dataclass(frozen=True, slots=True)
class PeerCounts:
    """What one router said it has at each replica (replicas with nothing are left out),
    what it took from each limited tenant's buckets in all (requests, tokens), and per tier its
    active tenants' requests in flight (``Admission.flows``)."""

    router: str
    replicas: Mapping[str, Counts]
    tenants: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    flows: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


def encode_counts(
    router: str,
    replicas: Iterable[tuple[str, Counts]],
    tenants: Mapping[str, tuple[float, float]] | None = None,
    flows: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, Any]:
    """The JSON a router serves: its id; per replica it has anything at, [in flight, pending
    prefill blocks, recent sends]; per tenant with limits, [requests, tokens] it took in all;
    per tier, each active tenant's requests in flight there."""
    return {
        "router": router,
        "replicas": {
            rid: [c.in_flight, c.pending_prefill, c.recent_sends]
            for rid, c in replicas
            if c.in_flight or c.pending_prefill or c.recent_sends
        },
        "tenants": {name: [r, t] for name, (r, t) in (tenants or {}).items()},
        "flows": {tier: dict(active) for tier, active in (flows or {}).items()},
    }


def _numbers(value: object, sizes: tuple[int, ...], non_negative: bool) -> list[float] | None:
    """``value`` as a list of finite numbers of one of ``sizes``; None if it is not one."""
    if (
        not isinstance(value, list)
        or len(value) not in sizes
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        or not all(math.isfinite(v) and (v >= 0 or not non_negative) for v in value)
    ):
        return None
    return [float(v) for v in value]


def parse_counts(data: object) -> PeerCounts:
    """A peer's answer (``encode_counts``); ValueError saying what is wrong with it."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    router = data.get("router")
    replicas = data.get("replicas")
    if not isinstance(router, str) or not router:
        raise ValueError("'router' must be a non-empty string")
    if not isinstance(replicas, dict):
        raise ValueError("'replicas' must be an object")
    tenants = data.get("tenants", {})
    if not isinstance(tenants, dict):
        raise ValueError("'tenants' must be an object")
    if len(replicas) > MAX_REPLICAS or len(tenants) > MAX_REPLICAS:
        raise ValueError(f"'replicas' or 'tenants' lists more than {MAX_REPLICAS}")
    parsed = {}
    for rid, value in replicas.items():
        # Two numbers: a router from before recent sends were shared (a rolling update).
        numbers = _numbers(value, (2, 3), non_negative=True)
        if numbers is None:
            raise ValueError(
                f"replica {rid!r}: expected [in_flight, pending_prefill, recent_sends] >= 0"
            )
        parsed[rid] = Counts(int(numbers[0]), *numbers[1:])
    spent = {}
    for name, value in tenants.items():
        numbers = _numbers(value, (2,), non_negative=False)
        if numbers is None:
            raise ValueError(f"tenant {name!r}: expected [requests, tokens] taken")
        spent[name] = (numbers[0], numbers[1])
    return PeerCounts(router, parsed, spent, _parse_flows(data.get("flows", {})))


def _parse_flows(flows: object) -> dict[str, dict[str, int]]:
    """A peer's ``flows`` (absent from a router older than them: none)."""
    if not isinstance(flows, dict):
        raise ValueError("'flows' must be an object")
    parsed: dict[str, dict[str, int]] = {}
    entries = 0
    for tier, active in flows.items():
        if not isinstance(active, dict):
            raise ValueError(f"flows of tier {tier!r}: expected an object of tenants")
        entries += len(active)
        if entries > MAX_REPLICAS:
            raise ValueError(f"'flows' lists more than {MAX_REPLICAS} tenants")
        counts = {}
        for tenant, n in active.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(
                    f"flows of tier {tier!r}, tenant {tenant!r}: expected a count >= 0"
                )
            counts[tenant] = n
        parsed[tier] = counts
    return parsed


class PeerBook:
    """Each peer's latest counts and how many asks in a row it has missed since; the sums the
    views add. Pure.

    A peer is lost after ``STALE_ROUNDS`` unanswered asks, not after a time: a router whose own
    loop is starved (a busy node) asks late, and must not take its peers for gone meanwhile -
    flapping between shared and own-share tenant buckets costs admissions (see ``limits``)."""

    def __init__(self, stale_after: int = STALE_ROUNDS) -> None:
        self.stale_after = stale_after
        self._latest: dict[str, PeerCounts] = {}  # by peer router id
        self._misses: dict[str, int] = {}  # by peer router id: asks unanswered in a row
        self._known: dict[str, str] = {}  # address -> the router id it last answered with

    def heard(self, address: str, counts: PeerCounts) -> None:
        previous = self._known.get(address)
        if previous is not None and previous != counts.router:
            self._drop(previous)  # that pod restarted, or the address moved
        self._known[address] = counts.router
        self._latest[counts.router] = counts
        self._misses[counts.router] = 0

    def missed(self, address: str) -> None:
        """The peer at ``address`` did not answer an ask (refused, timed out, garbage)."""
        peer = self._known.get(address)
        if peer is not None:
            self._misses[peer] = self._misses.get(peer, 0) + 1

    def retain(self, addresses: Iterable[str]) -> None:
        """Forget peers at addresses no longer listed (a scaled-down router's counts end with
        it, without waiting to go stale)."""
        keep = set(addresses)
        for address in [a for a in self._known if a not in keep]:
            self._drop(self._known.pop(address))

    def _drop(self, peer: str) -> None:
        self._latest.pop(peer, None)
        self._misses.pop(peer, None)

    def live_ids(self) -> set[str]:
        """The peer routers whose counts count: answered within the last asks."""
        return {peer for peer, misses in self._misses.items() if misses < self.stale_after}

    def live(self) -> int:
        return len(self.live_ids())

    def lost(self) -> int:
        return len(self._latest) - self.live()

    def totals(self) -> dict[str, Counts]:
        """Per replica, the live peers' counts summed."""
        sums: dict[str, Counts] = {}
        for peer in self.live_ids():
            for rid, c in self._latest[peer].replicas.items():
                had = sums.get(rid)
                sums[rid] = c if had is None else had + c
        return sums

    def flows(self) -> dict[str, dict[str, int]]:
        """Per tier, the tenants active at any live peer and their requests in flight there,
        summed."""
        sums: dict[str, dict[str, int]] = {}
        for peer in self.live_ids():
            for tier, active in self._latest[peer].flows.items():
                tier_sums = sums.setdefault(tier, {})
                for tenant, n in active.items():
                    tier_sums[tenant] = tier_sums.get(tenant, 0) + n
        return sums


class PeerExchange(ReplicaRounds):
    """Reads every peer's counts each round and writes their sums onto the replicas
    (``ReplicaState.peer_in_flight``/``peer_pending``/``peer_recent``), into the fair queue's
    admission (``Admission.set_peer_flows``) and the tenant limiter: it is their one writer.
    It follows the config's ``peers`` as it is reloaded: unset, a round clears the peers'
    counts."""

    name = "peers"

    def __init__(
        self,
        router: Router,
        metrics: RouterMetrics,
        router_id: str,
        limiter: Limiter,
        admission: Admission[Any],
    ) -> None:
        super().__init__(router, metrics, interval_s=IDLE_INTERVAL_S, timeout_s=IDLE_INTERVAL_S)
        self.router_id = router_id
        # The tenants' buckets: debited by what the peers took (``routing.limits``).
        self.limiter = limiter
        # The fair queue's counts of each tier's tenants (``routing.admission``).
        self.admission = admission
        self.book = PeerBook()
        self._resolved: tuple[str, ...] = ()
        self._resolved_of: tuple[str, int] | None = None
        self._resolved_at = -math.inf
        self._self: set[str] = set()  # addresses that answered with this router's own id
        self._unresolved = False  # the last resolution failed (logged once until it works)

    def new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def addresses(self, peers: Peers, port: int) -> tuple[str, ...]:
        """The peers to ask: static ones and the Service's, re-resolved now and then (a name
        that does not resolve keeps its last addresses: DNS trouble is not every peer gone)."""
        now = time.monotonic()
        if peers.service is None:
            self._resolved = ()
        elif (peers.service, port) != self._resolved_of or now >= self._resolved_at + RESOLVE_S:
            self._resolved_at = now
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    peers.service, port, type=socket.SOCK_STREAM
                )
            except OSError as exc:
                self.metrics.peer_errors.labels("resolve").inc()
                if not self._unresolved:  # once a streak: not every RESOLVE_S
                    log.warning("peer service does not resolve", extra={"err": str(exc)})
                self._unresolved = True
            else:
                self._unresolved = False
                self._resolved = tuple(
                    sorted({_host_port(str(info[4][0]), port) for info in infos})
                )
                self._resolved_of = (peers.service, port)
        listed = dict.fromkeys((*peers.addresses, *self._resolved))
        return tuple(a for a in listed if a not in self._self)

    async def round(self, session: aiohttp.ClientSession) -> None:
        config = self.router.config
        peers = config.peers
        addresses: tuple[str, ...] = ()
        if peers is None:
            self.interval_s = self.timeout_s = IDLE_INTERVAL_S
        else:
            self.interval_s = self.timeout_s = peers.interval.total_seconds()
            port = peers.port or config.metrics_port or config.port
            addresses = await self.addresses(peers, port)
        self.book.retain(addresses)
        if addresses:
            await asyncio.gather(*(self._ask(session, a) for a in addresses))
        totals = self.book.totals()
        none = Counts()
        for replica in self.router.replicas():
            c = totals.get(replica.id, none)
            replica.peer_in_flight = c.in_flight
            replica.peer_pending = c.pending_prefill
            replica.peer_recent = c.recent_sends
        self.admission.set_peer_flows(self.book.flows())
        live = self.book.live_ids()
        self.limiter.set_peers(len(live))
        # A lost peer's spending totals go: when it answers again its report is a new
        # baseline, not a debt - what it admitted meanwhile came out of its own share.
        self.limiter.forget_peers(live)
        self.metrics.peers.labels("live").set(len(live))
        self.metrics.peers.labels("lost").set(self.book.lost())

    async def _ask(self, session: aiohttp.ClientSession, address: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with session.get(f"http://{address}{PEER_COUNTS_PATH}", timeout=timeout) as r:
                if r.status != 200:
                    raise ValueError(f"status {r.status}")
                if (r.content_length or 0) > MAX_ANSWER_BYTES:
                    raise ValueError("answer too large")
                counts = parse_counts(await r.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.metrics.peer_errors.labels(type(exc).__name__).inc()
            self.book.missed(address)
            return
        if counts.router == self.router_id:
            self._self.add(address)  # our own pod behind the Service: never ask it again
            return
        self.book.heard(address, counts)
        self.limiter.peer_spent(counts.router, dict(counts.tenants), time.monotonic())


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = [
    "PEER_COUNTS_PATH",
    "Counts",
    "PeerBook",
    "PeerCounts",
    "PeerExchange",
    "encode_counts",
    "new_router_id",
    "parse_counts",
]
