"""A Prometheus that dies: restarted on its port, and meanwhile the engines read directly.

Regression (issue 12, item 2): under ``fleetpilot up`` a killed Prometheus stayed dead and the
autoscaler held every role in silence, forever, although it could read the engines' /metrics
itself. Here a real Prometheus scrapes a fake vLLM engine (support.py); it is SIGKILLed, the
:class:`FallbackSource` reads the engine directly and says so, the server is restarted by
:meth:`PrometheusServer.restart_if_exited`, and the source goes back to it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from fleetpilot.autoscaler.direct import EngineMetricsSource
from fleetpilot.autoscaler.fallback import FallbackSource
from fleetpilot.autoscaler.model import DataProblem, History, Metrics, Observation
from fleetpilot.autoscaler.model import RolePolicy as Policy
from fleetpilot.autoscaler.policy import decide
from fleetpilot.autoscaler.prometheus import PrometheusSource
from fleetpilot.runtime.prometheus import PrometheusServer, find_binary
from fleetpilot.testing.polling import eventually
from tests.autoscaler.support import Engine, EngineKey

WINDOW = timedelta(seconds=10)
KEY = EngineKey("ml", "fallback", "small", "unified")
# Generous: a busy machine starts Prometheus in seconds, and it hands targets over every 5 s.
SETTLE_S = 60.0


@pytest.fixture
def engine() -> Iterator[Engine]:
    fake = Engine(KEY)
    fake.set(kv=0.25, waiting=1, running=2)
    yield fake
    fake.close()


@pytest.fixture
def prometheus(tmp_path: Path, engine: Engine) -> Iterator[PrometheusServer]:
    try:
        find_binary()
    except Exception as exc:
        pytest.skip(str(exc))
    with PrometheusServer(tmp_path / "prometheus", [engine.target()]) as server:
        server.wait_scraped(SETTLE_S)
        yield server


def observe(source: FallbackSource) -> Metrics:
    return source.observe(KEY.service, KEY.tier, KEY.role, WINDOW, namespace=KEY.namespace)


def wait_for(source: FallbackSource, done: Callable[[Metrics], bool], what: str) -> Metrics:
    return eventually(what, lambda: observe(source), SETTLE_S, until=done)


def test_a_killed_prometheus_is_restarted_and_the_engines_are_read_meanwhile(
    prometheus: PrometheusServer, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 12, item 2: Prometheus SIGKILLed under a running source; the engine is read
    directly (said in the log and in every reason, never scaling down on the thin first
    scrape), Prometheus is restarted on its URL, and the source goes back to it."""
    caplog.set_level(logging.WARNING, logger="fleetpilot.autoscaler.fallback")
    primary = PrometheusSource(prometheus.url, timeout_s=2.0)
    direct = EngineMetricsSource(lambda tier, role: [engine.address])
    url = prometheus.url
    with FallbackSource(primary, direct, primary_name=f"prometheus at {url}", recheck_s=0) as src:
        healthy = wait_for(src, lambda m: m.problem is None, "data from prometheus")
        assert healthy.source_note == ""
        assert healthy.kv_cache_usage_frac == pytest.approx(0.25)
        assert not src.falling_back

        killed = prometheus.pid
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        m = wait_for(src, lambda m: m.source_note != "", "the fallback")
        assert src.falling_back
        assert m.problem is None, m.detail
        assert m.kv_cache_usage_frac == pytest.approx(0.25)  # read from the engine itself
        assert m.waiting_requests == 1
        assert m.source_note.startswith(
            f"read from the engines' /metrics directly: cannot connect to prometheus at {url}"
        )
        assert "reading the engines' /metrics directly until it answers again" in caplog.text
        # The fallback's first scrape has no rates: an idle-looking role of 3 holds, and the
        # reason says where the numbers came from.
        policy = Policy("unified", 1, 5, ttft_p95_slo_s=0.5, tpot_p95_slo_s=0.1)
        decision = decide(Observation(3, 3, m), policy, History(), 0.0)
        assert decision.replicas == 3
        assert decision.data_problem is DataProblem.MISSING
        assert decision.reason.endswith(f"[{m.source_note}]")

        report = prometheus.restart_if_exited()
        assert report is not None
        assert f"prometheus (pid {killed}) exited with code -9; restarting it on {url}" in report
        assert "Last lines of" in report
        assert prometheus.url == url  # the autoscaler keeps its URL
        assert prometheus.pid != killed
        assert prometheus.restart_if_exited() is None  # one report per crash
        back = wait_for(src, lambda m: m.source_note == "", "prometheus again")
        assert not src.falling_back
        assert back.problem is not DataProblem.UNREACHABLE
        assert f"prometheus at {url} answers again: reading it" in caplog.text
        wait_for(src, lambda m: m.problem is None and m.source_note == "", "fresh data")


def test_a_crash_loop_backs_off_between_restarts(prometheus: PrometheusServer) -> None:
    """A Prometheus that crashes again is restarted at once the first time, then only after
    a back-off (1 s here), so a crash loop does not spin the supervisor."""
    first = prometheus.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    report = eventually("the kill seen", prometheus.restart_if_exited, SETTLE_S, interval=0.05)
    assert "restarting it on" in report
    assert " in " not in report.split("Last lines")[0]  # the first crash restarts at once
    second = prometheus.pid
    assert second != first

    assert second is not None
    os.kill(second, signal.SIGKILL)
    # The clock is the monotonic one restart_if_exited reads; passed in, so "later" is exact.
    now = 0.0

    def seen_now() -> str | None:
        nonlocal now
        now = time.monotonic()
        return prometheus.restart_if_exited(now=now)

    report = eventually("the second kill seen", seen_now, SETTLE_S, interval=0.05)
    assert f"restarting it on {prometheus.url} in 1s" in report
    assert prometheus.restart_if_exited(now=now + 0.5) is None
    assert prometheus.pid == second  # not yet
    assert prometheus.restart_if_exited(now=now + 1.0) is None
    assert prometheus.pid != second
    assert {first, second, prometheus.pid} <= prometheus.pids
