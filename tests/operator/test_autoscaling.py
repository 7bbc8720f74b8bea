"""The operator's autoscaler loop: every service it has seen, ticked; none lost to another's
failure; a deleted one no longer ticked."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

from fleetpilot.operator.autoscaling import ServiceTicker


def _body(name: str, namespace: str = "ns", **metadata: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, **metadata}, "spec": {}}


def test_every_service_seen_is_ticked_with_its_latest_body_and_deleted_ones_are_not() -> None:
    ticked: list[Mapping[str, Any]] = []
    lock = threading.Lock()

    def tick(body: Mapping[str, Any]) -> None:
        with lock:
            ticked.append(body)

    ticker = ServiceTicker(tick, every_s=60)
    ticker.observe(None, _body("a"))  # listed at start: kopf gives no type
    ticker.observe("ADDED", _body("b"))
    newer = _body("a", resourceVersion="2")
    ticker.observe("MODIFIED", newer)
    ticker.observe("ADDED", _body("c"))
    ticker.observe("MODIFIED", _body("c", deletionTimestamp="2026-12-03T00:00:00Z"))
    ticker.observe("ADDED", _body("d", namespace="other"))
    ticker.observe("DELETED", _body("d", namespace="other"))
    assert ticker.services == [("ns", "a"), ("ns", "b")]
    asyncio.run(ticker.tick_all())
    ticker.close()
    assert sorted(b["metadata"]["name"] for b in ticked) == ["a", "b"]
    assert next(b for b in ticked if b["metadata"]["name"] == "a") is newer


def test_one_service_failing_never_stops_the_others() -> None:
    ticked: list[str] = []

    def tick(body: Mapping[str, Any]) -> None:
        name = body["metadata"]["name"]
        if name == "broken":
            raise RuntimeError("the API server refused")
        ticked.append(name)

    ticker = ServiceTicker(tick, every_s=60)
    for name in ("broken", "fine"):
        ticker.observe("ADDED", _body(name))
    asyncio.run(ticker.tick_all())
    asyncio.run(ticker.tick_all())
    ticker.close()
    assert ticked == ["fine", "fine"]


def test_run_ticks_every_interval_until_cancelled() -> None:
    ticks = threading.Semaphore(0)

    def tick(body: Mapping[str, Any]) -> None:
        ticks.release()

    async def main() -> int:
        ticker = ServiceTicker(tick, every_s=0.01)
        ticker.observe("ADDED", _body("a"))
        task = asyncio.create_task(ticker.run())
        seen = 0
        while seen < 3:
            await asyncio.to_thread(ticks.acquire)
            seen += 1
        task.cancel()
        ticker.close()
        return seen

    assert asyncio.run(asyncio.wait_for(main(), timeout=30)) == 3


def test_a_report_holds_for_its_generation_and_is_forgotten_with_the_service() -> None:
    ticker = ServiceTicker(lambda body: None, every_s=60)
    first = _body("a", generation=1)
    ticker.observe("ADDED", first)
    assert not ticker.reported_for(first)
    ticker.reported(first)
    assert ticker.reported_for(first)
    assert ticker.reported_for(_body("a", generation=1, resourceVersion="9"))  # a later body
    assert not ticker.reported_for(_body("a", generation=2))  # a new spec: report again
    assert not ticker.reported_for(_body("a", namespace="other", generation=1))
    ticker.observe("DELETED", first)
    assert not ticker.reported_for(first)  # a service made again under the name is new
    ticker.close()
