"""Router replicas sharing their in-flight counts (issue 44): the peer book's sums, staleness
and forgetting, the wire format's checks, and what a replica's view makes of peers' counts."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.api.router_config import EndpointGroup, RouterConfig
from fleetpilot.routing.endpoints import Endpoint
from fleetpilot.routing.peers import (
    STALE_ROUNDS,
    Counts,
    PeerBook,
    PeerCounts,
    encode_counts,
    parse_counts,
)
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.runtime.processes import free_ports
from fleetpilot.testing.polling import eventually_async
from tests.routing.support import (
    FakeEngine,
    engines,
    make_config,
    router_process,
    running_router,
    tier,
    wait_for,
)


def counts(router: str, **replicas: tuple[int, float]) -> PeerCounts:
    return PeerCounts(router, {rid: Counts(*c) for rid, c in replicas.items()})


def test_the_book_sums_live_peers_per_replica() -> None:
    book = PeerBook()
    book.heard("10.0.0.2:9000", counts("b", r1=(2, 30.0), r2=(1, 0.0)))
    book.heard("10.0.0.3:9000", counts("c", r1=(1, 5.0)))
    assert book.totals() == {"r1": Counts(3, 35.0), "r2": Counts(1, 0.0)}
    assert (book.live(), book.lost()) == (2, 0)


def test_a_peer_that_misses_three_asks_stops_counting_and_is_reported_lost() -> None:
    """Its counts describe requests long finished or moved: the router is back to its own.
    Two misses (a slow answer, a busy node) are not enough: flapping costs admissions."""
    book = PeerBook()
    book.heard("b:1", counts("b", r1=(4, 0.0)))
    book.heard("c:1", counts("c", r1=(1, 0.0)))
    book.missed("b:1")
    book.missed("b:1")
    assert book.totals() == {"r1": Counts(5, 0.0)}
    book.missed("b:1")
    assert book.totals() == {"r1": Counts(1, 0.0)}
    assert (book.live(), book.lost()) == (1, 1)
    assert book.live_ids() == {"c"}
    book.heard("b:1", counts("b", r1=(2, 0.0)))  # it answers again: it counts again
    assert book.totals() == {"r1": Counts(3, 0.0)}


def test_a_restarted_peer_replaces_its_old_counts() -> None:
    """A new process at the same address (a new id): the old one's requests died with it."""
    book = PeerBook()
    book.heard("b:1", counts("old", r1=(4, 0.0)))
    book.heard("b:1", counts("new", r1=(1, 0.0)))
    assert book.totals() == {"r1": Counts(1, 0.0)}
    assert (book.live(), book.lost()) == (1, 0)


def test_a_peer_no_longer_listed_is_forgotten_at_once() -> None:
    book = PeerBook()
    book.heard("b:1", counts("b", r1=(4, 0.0)))
    book.heard("c:1", counts("c", r1=(1, 0.0)))
    book.retain(["c:1"])
    assert book.totals() == {"r1": Counts(1, 0.0)}
    assert (book.live(), book.lost()) == (1, 0)


def test_counts_round_trip_and_idle_replicas_are_left_out() -> None:
    wire = encode_counts(
        "a", [("r1", Counts(2, 12.5, 7.0)), ("r2", Counts()), ("r3", Counts(0, 3.0))]
    )
    assert wire == {
        "router": "a",
        "replicas": {"r1": [2, 12.5, 7.0], "r3": [0, 3.0, 0.0]},
        "tenants": {},
        "flows": {},
    }
    assert parse_counts(wire).replicas == {"r1": Counts(2, 12.5, 7.0), "r3": Counts(0, 3.0)}
    # A router from before recent sends were shared (a rolling update) sends two numbers.
    old = {"router": "a", "replicas": {"r1": [1, 4.0]}}
    assert parse_counts(old) == counts("a", r1=(1, 4.0))
    spent = encode_counts("a", [], {"team": (3.0, 120.0)})
    assert parse_counts(spent).tenants == {"team": (3.0, 120.0)}
    flows = encode_counts("a", [], flows={"small": {"team": 2, "quiet": 0}})
    assert parse_counts(flows).flows == {"small": {"team": 2, "quiet": 0}}
    assert parse_counts(old).flows == {}  # from before flows were shared: none


def test_the_book_sums_the_live_peers_flows_per_tier_and_tenant() -> None:
    """What each router's fair queue adds to its own: the tenants active at any peer (0 in
    flight: active, keeping its headroom) and their requests in flight; a lost peer's go."""
    book = PeerBook()
    book.heard("b:1", PeerCounts("b", {}, flows={"small": {"x": 2, "y": 0}}))
    book.heard("c:1", PeerCounts("c", {}, flows={"small": {"x": 1}, "large": {"y": 3}}))
    assert book.flows() == {"small": {"x": 3, "y": 0}, "large": {"y": 3}}
    for _ in range(STALE_ROUNDS):
        book.missed("c:1")
    assert book.flows() == {"small": {"x": 2, "y": 0}}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "not a JSON object"),
        ({"replicas": {}}, "'router' must be a non-empty string"),
        ({"router": "a", "replicas": []}, "'replicas' must be an object"),
        ({"router": "a", "replicas": {"r": [1]}}, "replica 'r'"),
        ({"router": "a", "replicas": {"r": [-1, 0]}}, "replica 'r'"),
        ({"router": "a", "replicas": {"r": [True, 0]}}, "replica 'r'"),
        ({"router": "a", "replicas": {"r": ["1", 0]}}, "replica 'r'"),
        ({"router": "a", "replicas": {"r": [1, float("nan")]}}, "replica 'r'"),
        ({"router": "a", "replicas": {}, "tenants": []}, "'tenants' must be an object"),
        ({"router": "a", "replicas": {}, "tenants": {"t": [1]}}, "tenant 't'"),
        ({"router": "a", "replicas": {}, "flows": []}, "'flows' must be an object"),
        ({"router": "a", "replicas": {}, "flows": {"s": [1]}}, "flows of tier 's'"),
        ({"router": "a", "replicas": {}, "flows": {"s": {"t": -1}}}, "tenant 't'"),
        ({"router": "a", "replicas": {}, "flows": {"s": {"t": 1.5}}}, "tenant 't'"),
    ],
)
def test_a_malformed_answer_is_refused_with_what_is_wrong(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_counts(data)


def test_a_replica_view_adds_the_peers_counts_to_its_own() -> None:
    """What the policies read: the requests every router has there, so each router spreads a
    hot tenant when the replica's queue, not its own share of it, makes that worth it."""
    state = ReplicaState(Endpoint("small", "unified", "10.0.0.1", 1), max_num_seqs=4)
    state.in_flight, state.pending_prefill = 1, 10.0
    alone = state.view(now=0.0, stale_after_s=5.0, ejected=False)
    state.peer_in_flight, state.peer_pending = 3, 40.0
    shared = state.view(now=0.0, stale_after_s=5.0, ejected=False)
    assert (alone.in_flight, alone.pending_prefill) == (1, 10.0)
    assert (shared.in_flight, shared.pending_prefill) == (4, 50.0)
    assert shared.demand == 4.0
    assert shared.ahead == 1.0  # a full batch: a new request would wait


def config_with(**overrides: object) -> dict[str, object]:
    group = EndpointGroup(role="unified", service="e", selector={}, port=1, max_num_seqs=4,
                          addresses=["127.0.0.1:1"])  # fmt: skip
    return {**make_config([tier("small", 1.0, groups=[group])]).to_wire(), **overrides}


@pytest.mark.parametrize(
    ("peers", "extra", "message"),
    [
        ({}, {}, "peers needs a service or addresses"),
        ({"addresses": ["a:1"], "interval": "0s"}, {}, "peers.interval must be positive"),
        (
            {"addresses": ["a:1"]},
            {"auth": {"tenants": [{"name": "t", "keyFiles": ["/keys/t"]}]}},
            "set metricsPort",
        ),
    ],
)
def test_invalid_peers_are_refused_naming_the_field(
    peers: dict[str, object], extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig.model_validate(config_with(peers=peers, **extra))


# ---- two router processes --------------------------------------------------------------------


async def requests_at(client: httpx.AsyncClient, port: int) -> dict[tuple[str, str], float]:
    """A router's ``fleetpilot_router_replica_requests`` by (replica, counted_by)."""
    text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    return {
        (s.labels["replica"], s.labels["counted_by"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "fleetpilot_router_replica_requests"
    }


async def gauge(client: httpx.AsyncClient, port: int, name: str, **labels: str) -> float:
    text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


@pytest.mark.asyncio
async def test_two_router_processes_agree_on_each_replicas_requests_within_a_scrape_interval(
    tmp_path: Path,
) -> None:
    """Requests held open at two engines, some sent through each router: within one scrape
    interval of the last one arriving, each router's count of every replica (its own plus
    its peer's) is what the engine holds. Then one router is killed: the other reports it
    lost, stops adding its counts, and goes on routing."""
    gate = asyncio.Event()
    fakes = [FakeEngine("a", gate=gate), FakeEngine("b", gate=gate)]
    async with engines(*fakes), httpx.AsyncClient(timeout=30) as client:
        ports = free_ports(2)
        scrape_s = 2.0
        config = make_config(
            [tier("small", 1.0, fakes, max_num_seqs=8)],
            scrape={"interval": f"{scrape_s:g}s", "staleAfter": "10s"},
            peers={"addresses": [f"127.0.0.1:{p}" for p in ports], "interval": "50ms"},
        )
        path = tmp_path / "router.yaml"
        path.write_text(yaml.safe_dump(config.to_wire()))
        with contextlib.ExitStack() as stack:
            # Started off the loop: the engines on it must answer the routers' first probes.
            procs = [
                (await asyncio.to_thread(stack.enter_context, router_process(path, port=p)))[0]
                for p in ports
            ]
            for port in ports:
                await eventually_async(
                    "each router hears its peer",
                    functools.partial(gauge, client, port, "fleetpilot_router_peers", state="live"),
                    30,
                    until=lambda live: live == 1,
                )
            body = {"model": "small-model", "prompt": "hello", "max_tokens": 2}
            sends = [ports[0]] * 3 + [ports[1]] * 2
            held = [
                asyncio.create_task(client.post(f"http://127.0.0.1:{p}/v1/completions", json=body))
                for p in sends
            ]
            await eventually_async(
                "every request at an engine",
                lambda: sum(len(f.requests) for f in fakes),
                30,
                until=lambda n: n == len(sends),
            )
            truth = {f.address: float(len(f.requests)) for f in fakes}

            async def agreed() -> bool:
                for port in ports:
                    seen = await requests_at(client, port)
                    for replica, n in truth.items():
                        if seen.get((replica, "self"), 0) + seen.get((replica, "peers"), 0) != n:
                            return False
                return True

            await eventually_async("both routers count what the engines hold", agreed, scrape_s,
                                   until=bool, interval=0.02)  # fmt: skip
            gate.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200] * len(sends)

            gate.clear()
            stuck = asyncio.create_task(
                client.post(f"http://127.0.0.1:{ports[1]}/v1/completions", json=body)
            )

            async def counted_for_peers() -> float:
                seen = await requests_at(client, ports[0])
                return sum(v for (_, by), v in seen.items() if by == "peers")

            await eventually_async(
                "the peer's request counted", counted_for_peers, 30, until=lambda n: n == 1
            )
            procs[1].kill()
            procs[1].wait(10)
            stuck.cancel()
            await eventually_async(
                "the killed router no longer counted", counted_for_peers, 30, until=lambda n: n == 0
            )
            assert await gauge(client, ports[0], "fleetpilot_router_peers", state="lost") == 1
            gate.set()
            answer = await client.post(f"http://127.0.0.1:{ports[0]}/v1/completions", json=body)
            assert answer.status_code == 200


@pytest.mark.asyncio
async def test_a_router_finds_itself_behind_the_peer_service_and_skips_it() -> None:
    """In a cluster the headless Service's name resolves to every router pod, this one
    included: it asks itself once, recognises its own id, and never counts itself."""
    engine = FakeEngine("a")
    async with engines(engine):
        (port,) = free_ports(1)
        config = make_config(
            [tier("small", 1.0, [engine])],
            metricsPort=port,
            peers={"service": "localhost", "interval": "50ms"},
        )
        async with running_router(config) as router:
            exchange = router.state.peers
            assert exchange is not None
            await wait_for(lambda: f"127.0.0.1:{port}" in exchange._self, timeout_s=10)
            assert router.metric("fleetpilot_router_peers", state="live") == 0


@pytest.mark.asyncio
async def test_a_peer_service_that_does_not_resolve_leaves_the_router_alone_and_routing() -> None:
    engine = FakeEngine("a")
    async with engines(engine):
        config = make_config(
            [tier("small", 1.0, [engine])],
            peers={"service": "no-such-router-peers.invalid", "interval": "50ms"},
        )
        async with running_router(config) as router, httpx.AsyncClient() as client:
            await wait_for(
                lambda: router.metric("fleetpilot_router_peer_errors_total", error="resolve") >= 1,
                timeout_s=20,
            )
            body = {"model": "small-model", "prompt": "hi", "max_tokens": 2}
            answer = await client.post(router.url + "/v1/completions", json=body)
            assert answer.status_code == 200
