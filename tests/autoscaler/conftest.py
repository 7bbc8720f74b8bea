"""Fixtures of the autoscaler tests: fake vLLM engines and a real Prometheus scraping them.

The engines (see support.py) exist for the whole session and are created before Prometheus
starts: Prometheus 2.x hands new targets to its scrapers only every 5 s, so one server, started
once, keeps the run short. Every engine belongs to a (namespace, service, tier, role) of its own
test scenario; tests never share an engine, so they drive them without stepping on each other.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetpilot.runtime.prometheus import PrometheusServer
from tests.autoscaler.support import DRIVE_PERIOD_S, Engine, EngineKey, Fleet

# (namespace, service, tier, role, engines, escaped): one line per test scenario.
ENGINES = [
    ("ml", "reader", "small", "unified", 2, None),  # one engine of each exposition format
    ("other", "reader", "small", "unified", 1, False),  # same names, other namespace
    ("ml", "reader", "large", "prefill", 1, False),
    ("ml", "reader", "large", "decode", 1, True),
    ("ml", "idle", "small", "unified", 1, False),
    ("ml", "burst", "small", "unified", 2, False),
    ("ml", "loop", "small", "unified", 1, False),
]


def _drive(fleet: list[Engine], stop: threading.Event) -> None:
    while not stop.wait(DRIVE_PERIOD_S):
        for engine in fleet:
            engine.tick()


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The session's fake engines, scraped every second by a real Prometheus."""
    engines: dict[EngineKey, list[Engine]] = {}
    every: list[Engine] = []
    stop = threading.Event()
    driver = threading.Thread(target=_drive, args=(every, stop), daemon=True)
    try:
        for namespace, service, tier, role, count, escaped in ENGINES:
            key = EngineKey(namespace, service, tier, role)
            engines[key] = [
                Engine(key, i, escaped=(i % 2 == 1) if escaped is None else escaped)
                for i in range(count)
            ]
            every.extend(engines[key])
        driver.start()
        workdir: Path = tmp_path_factory.mktemp("prometheus")
        with PrometheusServer(workdir, [e.target() for e in every]) as prometheus:
            prometheus.wait_scraped()
            yield Fleet(prometheus, engines)
    finally:
        stop.set()
        if driver.is_alive():
            driver.join(timeout=5)
        for engine in every:
            engine.close()
