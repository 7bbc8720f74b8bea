"""The fair queue: strict priority classes, weighted fair order across tenants within one,
shedding the newest of the lowest class when full."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from fleetpilot.api.router_config import AuthConfig, RouterConfig, TenantKeys
from fleetpilot.routing.admission import ACTIVE_WINDOW_S
from fleetpilot.routing.flow import FairQueue, QueueFullError, may_start
from fleetpilot.runtime.processes import free_ports
from tests.routing.support import (
    SHORT,
    FakeEngine,
    RunningRouter,
    assert_openai_error,
    engines,
    make_config,
    post,
    running_router,
    tier,
    wait_for,
)


class Clock:
    """Monotonic seconds that move only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _drain(queue: FairQueue) -> list[str]:
    order = []
    while (head := queue.head()) is not None:
        queue.dispatch(head)
        order.append(head.tenant)
    return order


def test_a_heavy_tenant_queues_behind_itself() -> None:
    """A sends ten requests before B sends two: B's go second and fourth, not last."""
    queue = FairQueue(max_queued=100)
    for _ in range(10):
        queue.enqueue("a", 1.0, 0, deadline=60.0)
    for _ in range(2):
        queue.enqueue("b", 1.0, 0, deadline=60.0)
    assert _drain(queue)[:5] == ["a", "b", "a", "b", "a"]


def test_weights_set_the_shares() -> None:
    """B of weight 3 gets three turns to A's one while both wait."""
    queue = FairQueue(max_queued=100)
    for _ in range(8):
        queue.enqueue("a", 1.0, 0, deadline=60.0)
        queue.enqueue("b", 3.0, 0, deadline=60.0)
    first = _drain(queue)[:8]
    assert first.count("b") == 6
    assert first.count("a") == 2


def test_a_late_arrival_is_not_owed_the_past() -> None:
    """A tenant idle while others were served starts at the current virtual time: it does
    not take every turn to catch up."""
    queue = FairQueue(max_queued=100)
    for _ in range(6):
        queue.enqueue("a", 1.0, 0, deadline=60.0)
    for _ in range(4):
        head = queue.head()
        assert head is not None
        queue.dispatch(head)
    for _ in range(3):
        queue.enqueue("b", 1.0, 0, deadline=60.0)
    assert _drain(queue) == ["a", "b", "a", "b", "b"]


def test_a_higher_class_goes_first_and_the_lowest_newest_is_shed() -> None:
    queue = FairQueue(max_queued=3)
    queue.enqueue("batch", 1.0, 0, deadline=60.0)
    newest_batch, _ = queue.enqueue("batch", 1.0, 0, deadline=60.0)
    queue.enqueue("chat", 1.0, 1, deadline=60.0)
    _, shed = queue.enqueue("chat", 1.0, 1, deadline=60.0)  # full: a batch request goes
    assert shed is newest_batch
    with pytest.raises(QueueFullError):
        queue.enqueue("batch", 1.0, 0, deadline=60.0)  # nothing lower to shed: this one
    assert _drain(queue) == ["chat", "chat", "batch"]


# -- at the router -------------------------------------------------------------------------


def test_each_other_active_tenant_keeps_its_headroom_within_its_share() -> None:
    """8 slots, a and b active with equal weights, headroom 2: a may fill the slots b leaves
    but two, b may always start while it is under its share; headroom 0 fills every slot."""
    both = {"a": 1.0, "b": 1.0}
    assert may_start("a", both, {"a": 5}, slots=8, headroom=2)  # 6 held with b's 2 kept
    assert not may_start("a", both, {"a": 6}, slots=8, headroom=2)
    assert not may_start("a", both, {"a": 4, "b": 2}, slots=8, headroom=2)
    assert may_start("b", both, {"a": 6, "b": 1}, slots=8, headroom=2)
    assert may_start("a", both, {"a": 7}, slots=8, headroom=0)
    # b's share caps what it keeps: at its share it keeps nothing, and a has the rest.
    assert may_start("a", both, {"a": 3, "b": 4}, slots=8, headroom=2)
    # Weights set the share: b of weight 1 against a's 3 holds 2 of 8 at most.
    assert may_start("a", {"a": 3.0, "b": 1.0}, {"a": 5, "b": 1}, slots=8, headroom=4)
    assert not may_start("a", {"a": 3.0, "b": 1.0}, {"a": 6, "b": 0}, slots=8, headroom=4)


KEYS = {"a": "sk-tenant-a-0123456789abcdef", "b": "sk-tenant-b-0123456789abcdef"}


def _tenants(tmp_path: Path, *names: str) -> list[TenantKeys]:
    for name in names:
        (tmp_path / name).write_text(KEYS[name])
    return [TenantKeys(name=name, key_files=[str(tmp_path / name)]) for name in names]


def _config(
    tmp_path: Path, engine: FakeEngine, flow: dict[str, Any], **tenants: dict[str, Any]
) -> RouterConfig:
    """One engine that runs one request at a time, tenants a and b, and the fair queue."""
    specs = []
    for name, extra in tenants.items():
        (tmp_path / name).write_text(KEYS[name])
        specs.append(TenantKeys(name=name, key_files=[str(tmp_path / name)], **extra))
    return make_config(
        [tier("only", 1.0, [engine], max_num_seqs=1)],
        auth=AuthConfig(tenants=specs),
        flow=flow,
        spillover={"enabled": False},
    )


async def _send(router: RunningRouter, tenant: str, tag: str) -> int:
    body = {"model": "chat", "prompt": tag, "max_tokens": 1}
    status, _, _ = await post(router, body, headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    return status


async def _release_one_by_one(engine: FakeEngine, gate: asyncio.Event, count: int) -> None:
    """Let the engine answer its requests one at a time, as each arrives."""
    for n in range(1, count + 1):
        await wait_for(lambda n=n: len(engine.requests) >= n, timeout_s=10.0)
        gate.set()
        gate.clear()  # releases exactly the request waiting now


@pytest.mark.asyncio
async def test_a_saturated_fleet_serves_tenants_in_fair_turns(tmp_path: Path) -> None:
    """The engine runs one request at a time. Tenant a sends four, then b sends two: instead
    of 429s they wait in the router, and b's take turns with a's, not after all of a's."""
    gate = asyncio.Event()
    engine = FakeEngine("e", gate=gate)
    async with engines(engine):
        config = _config(tmp_path, engine, {"maxWait": "20s"}, a={}, b={})
        async with running_router(config) as router:
            sends = [asyncio.create_task(_send(router, "a", f"a{i}")) for i in range(4)]
            await wait_for(lambda: len(router.state.proxy.admission.queue) == 3)  # type: ignore[union-attr]
            sends += [asyncio.create_task(_send(router, "b", f"b{i}")) for i in range(2)]
            await wait_for(lambda: len(router.state.proxy.admission.queue) == 5)  # type: ignore[union-attr]
            assert router.metric("fleetpilot_router_queued_requests", tenant="a") == 3
            assert (
                router.metric("fleetpilot_router_pending_requests", tier="only", role="unified")
                == 5
            )
            await _release_one_by_one(engine, gate, 6)
            assert await asyncio.gather(*sends) == [200] * 6
            # Fair turns: a's queued requests have virtual finish tags 1, 2, 3 and b's 1, 2
            # (equal tags go by arrival), so b goes third and fifth - first come, first
            # served would have put both of b's last.
            order = [r["prompt"] for r in engine.requests]
            assert order == ["a0", "a1", "b0", "a2", "b1", "a3"]
            # Every request but the first waited for capacity, each counted for its tenant.
            waited = "fleetpilot_router_queue_wait_seconds_count"
            assert router.metric(waited, tenant="a") == 3
            assert router.metric(waited, tenant="b") == 2
            assert (
                router.metric("fleetpilot_router_pending_requests", tier="only", role="unified")
                == 0
            )


@pytest.mark.asyncio
async def test_a_request_that_cannot_get_capacity_in_time_is_refused(tmp_path: Path) -> None:
    gate = asyncio.Event()
    engine = FakeEngine("e", gate=gate)
    async with engines(engine):
        config = _config(tmp_path, engine, {"maxWait": "300ms"}, a={})
        async with running_router(config) as router:
            first = asyncio.create_task(_send(router, "a", "first"))
            await wait_for(lambda: len(engine.requests) == 1)
            started = time.monotonic()
            status, payload, headers = await post(
                router, SHORT, headers={"Authorization": f"Bearer {KEYS['a']}"}
            )
            assert_openai_error(status, payload, 429)
            assert headers["x-fleetpilot-error"] == "queue_timeout"
            assert "Retry-After" in headers
            assert time.monotonic() - started >= 0.3
            gate.set()
            assert await first == 200


@pytest.mark.asyncio
async def test_a_higher_class_goes_first_and_sheds_the_lowest_from_a_full_queue(
    tmp_path: Path,
) -> None:
    """One place in the queue: tenant a (class 0) waits in it; tenant b (class 1) arrives
    and takes it (a is refused, shed), then b is served before anything of class 0."""
    gate = asyncio.Event()
    engine = FakeEngine("e", gate=gate)
    async with engines(engine):
        config = _config(
            tmp_path, engine, {"maxWait": "20s", "maxQueued": 1}, a={}, b={"priority": 1}
        )
        async with running_router(config) as router:
            first = asyncio.create_task(_send(router, "a", "a0"))
            await wait_for(lambda: len(engine.requests) == 1)
            waiting = asyncio.create_task(_send(router, "a", "a1"))
            await wait_for(lambda: len(router.state.proxy.admission.queue) == 1)  # type: ignore[union-attr]
            urgent = asyncio.create_task(_send(router, "b", "b0"))
            assert await waiting == 429
            await _release_one_by_one(engine, gate, 2)
            assert await first == 200
            assert await urgent == 200
            assert [r["prompt"] for r in engine.requests] == ["a0", "b0"]


@pytest.mark.parametrize("headroom", [0, 2])
@pytest.mark.asyncio
async def test_a_flood_leaves_an_active_tenant_its_headroom(tmp_path: Path, headroom: int) -> None:
    """An engine of 4 slots. Tenant b has been active; tenant a sends 5 at once. With
    headroom 2, a runs 2 and queues 3, and b's next request starts at once; with headroom 0,
    a fills all 4 slots and b's request waits for one to free."""
    gate = asyncio.Event()
    engine = FakeEngine("e", gate=gate)
    async with engines(engine):
        config = make_config(
            [tier("only", 1.0, [engine], max_num_seqs=4)],
            auth=AuthConfig(tenants=_tenants(tmp_path, "a", "b")),
            flow={"maxWait": "20s", "headroom": headroom},
            spillover={"enabled": False},
        )
        async with running_router(config) as router:
            proxy = router.state.proxy
            assert proxy is not None
            # Time stands still: b stays active however slow this machine is.
            proxy.admission.clock = Clock()
            first = asyncio.create_task(_send(router, "b", "b0"))
            await _release_one_by_one(engine, gate, 1)
            assert await first == 200
            floods = [asyncio.create_task(_send(router, "a", f"a{i}")) for i in range(5)]
            running = 2 if headroom else 4
            await wait_for(lambda: len(engine.requests) == 1 + running)
            await wait_for(lambda: len(proxy.admission.queue) == 5 - running)
            b = asyncio.create_task(_send(router, "b", "b1"))
            if headroom:
                await wait_for(lambda: len(engine.requests) == 4)
                assert engine.requests[-1]["prompt"] == "b1"
            else:
                await wait_for(lambda: len(proxy.admission.queue) == 2)
                assert len(engine.requests) == 5
            gate.set()
            assert await asyncio.gather(*floods, b) == [200] * 6


@pytest.mark.asyncio
async def test_a_tenant_silent_past_the_active_window_keeps_no_headroom(tmp_path: Path) -> None:
    """An engine of 4 slots, headroom 2. Tenant b sent one request; tenant a floods 5: 2
    run while b counts as active. Once b has sent nothing for ``ACTIVE_WINDOW_S`` (the
    router's clock moved on), a's queued requests take the slots b kept: when a's two
    running requests end, all three queued start, not two."""
    gate = asyncio.Event()
    engine = FakeEngine("e", gate=gate)
    async with engines(engine):
        config = make_config(
            [tier("only", 1.0, [engine], max_num_seqs=4)],
            auth=AuthConfig(tenants=_tenants(tmp_path, "a", "b")),
            flow={"maxWait": "20s", "headroom": 2},
            spillover={"enabled": False},
        )
        async with running_router(config) as router:
            proxy = router.state.proxy
            assert proxy is not None
            clock = Clock()
            proxy.admission.clock = clock
            first = asyncio.create_task(_send(router, "b", "b0"))
            await _release_one_by_one(engine, gate, 1)
            assert await first == 200
            floods = [asyncio.create_task(_send(router, "a", f"a{i}")) for i in range(5)]
            await wait_for(lambda: len(engine.requests) == 3)
            await wait_for(lambda: len(proxy.admission.queue) == 3)
            clock.now += ACTIVE_WINDOW_S + 1  # b is past its window: a alone is active
            gate.set()
            gate.clear()  # a's two running requests end, and the queue moves
            # All three start: with b still active two would, and one would wait.
            await wait_for(lambda: len(engine.requests) == 6)
            assert len(proxy.admission.queue) == 0
            gate.set()
            assert await asyncio.gather(*floods) == [200] * 5


@pytest.mark.asyncio
async def test_two_routers_keep_a_tenant_active_at_either_its_headroom(tmp_path: Path) -> None:
    """Two peered routers (``routing.peers``) in front of an engine of 4 slots, headroom 2.
    Tenant b sent one request through the second router; tenant a floods 5 through the first,
    which sees b active at its peer: a runs 2 and queues 3 (a router alone would have run 4),
    and b's next request, through the second router, starts at once."""
    gate = asyncio.Event()
    engine = FakeEngine("e", gate=gate)
    ports = free_ports(2)
    peers = {"addresses": [f"127.0.0.1:{p}" for p in ports], "interval": "50ms"}
    auth = AuthConfig(tenants=_tenants(tmp_path, "a", "b"))
    async with engines(engine):
        configs = [
            make_config(
                [tier("only", 1.0, [engine], max_num_seqs=4)],
                auth=auth,
                flow={"maxWait": "20s", "headroom": 2},
                spillover={"enabled": False},
                metricsPort=port,
                peers=peers,
            )
            for port in ports
        ]
        async with running_router(configs[0]) as first, running_router(configs[1]) as second:
            for router in (first, second):
                await wait_for(
                    lambda r=router: r.metric("fleetpilot_router_peers", state="live") == 1
                )
            flooded, quiet = first.state.proxy, second.state.proxy
            assert flooded is not None
            assert quiet is not None
            # Time stands still at the second router: b stays active there however slow
            # this machine is.
            quiet.admission.clock = Clock()
            b0 = asyncio.create_task(_send(second, "b", "b0"))
            await _release_one_by_one(engine, gate, 1)
            assert await b0 == 200
            # The first router hears of b before a floods it.
            await wait_for(lambda: flooded.admission.active_tenants("only") == {"b"})
            floods = [asyncio.create_task(_send(first, "a", f"a{i}")) for i in range(5)]
            await wait_for(lambda: len(engine.requests) == 3)
            await wait_for(lambda: len(flooded.admission.queue) == 3)
            # The second router hears of a before b's next request.
            await wait_for(lambda: quiet.admission.active_tenants("only") == {"a", "b"})
            b1 = asyncio.create_task(_send(second, "b", "b1"))
            await wait_for(lambda: len(engine.requests) == 4)
            assert engine.requests[-1]["prompt"] == "b1"
            assert len(flooded.admission.queue) == 3
            gate.set()
            assert await asyncio.gather(*floods, b1) == [200] * 6
