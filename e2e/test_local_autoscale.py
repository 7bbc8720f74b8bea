"""The local autoscaler end to end: load through the router scales a role up, a lull down.

A one-tier service whose TTFT objective (5 ms) a handful of concurrent requests on a CPU
breaks. The stack runs ``fleetpilot autoscaler`` as its own process, reading either a real
Prometheus server (Debian's package, installed by ``make prometheus``) that scrapes the real
reference-engine processes, or the engines' /metrics directly; it starts and stops engine
processes through the fleet's control API, and the router's config follows. The knobs are the
service's own: a 1 s interval and a 10 s window make decisions come fast enough for a test, and
the default min_samples (10) is reached within a second of load.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from e2e.support import autoscaler_log, running_stack, step_until
from fleetpilot.runtime.local import LocalFleet
from fleetpilot.runtime.stack import LocalStack
from tests.factories import make_local_manifest

SERVICE = yaml.safe_dump(
    make_local_manifest(
        "auto",
        replicas={"min": 1, "max": 2},
        ttft_p95="5ms",
        max_num_seqs=16,
        scale_down_stabilization="5s",
    )
)
SCALE_DOWN_WINDOW_S = 5.0
# The load runs at least this long (the scale-up usually comes within a few seconds of it).
LOAD_S = 8.0
SCALE_UP_WAIT_S = 35.0  # a busy machine's engine start included
CONCURRENCY = 8
# A long-ish prompt makes prefill, hence TTFT, cost something even for the tiny model.
PROMPT = "Summarize the following text in one sentence. " + "The quick brown fox jumps. " * 12


def router_addresses(fleet: LocalFleet) -> list[str]:
    listed = yaml.safe_load(fleet.endpoints_path.read_text())["endpoints"]
    return [e["address"] for e in listed]


def load(url: str, stop: threading.Event, errors: list[str]) -> int:
    """Completions back to back until ``stop``; returns how many succeeded."""
    done = 0
    with httpx.Client(base_url=url, timeout=30.0, trust_env=False) as client:
        while not stop.is_set():
            body = {"model": "small-model", "prompt": f"{done} {PROMPT}", "max_tokens": 8}
            try:
                client.post("/completions", json=body).raise_for_status()
                done += 1
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
    return done


@pytest.fixture(params=["prometheus", "direct"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalStack]:
    with running_stack(tmp_path, SERVICE, prometheus=request.param == "prometheus") as local:
        yield local


def test_load_scales_up_on_ttft_and_a_lull_scales_down_after_the_window(
    stack: LocalStack,
) -> None:
    """Load breaks the 5 ms TTFT objective: an engine is added, the decision says why and
    with what it saw, the router lists the engine once healthy; after the load the role holds
    through its scale-down window, then goes back to one."""
    fleet = stack.fleet
    if stack.prometheus_url is not None:
        assert f"reading Prometheus at {stack.prometheus_url}" in autoscaler_log(stack)
    else:
        assert "reading the engines' /metrics directly" in autoscaler_log(stack)
    stop = threading.Event()
    errors: list[str] = []
    url = fleet.endpoint
    try:
        with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
            started = time.monotonic()
            workers = [pool.submit(load, url, stop, errors) for _ in range(CONCURRENCY)]
            try:
                step_until(
                    stack,
                    lambda: len(fleet.role_replicas("small", "unified")) == 2,
                    SCALE_UP_WAIT_S,
                    "a scale-up",
                )
                # The scale is recorded right after it is applied: wait for the record too.
                step_until(
                    stack,
                    lambda: any(d.replicas == 2 for d in stack.actuator.decisions),
                    10,
                    "the scale-up's record",
                )
                scale_up = next(
                    d for d in stack.actuator.decisions if d.replicas > d.current_replicas
                )
                assert "ttft p95" in scale_up.reason
                assert "> slo 5ms" in scale_up.reason
                # The step ends the reason or a note follows: its capacity "(...)", or once the
                # runtime has reported the first engine's start, "; new replicas serve in ~Ns".
                assert re.search(r"1 -> 2($| \(|;)", scale_up.reason), scale_up.reason
                # What it decided on travelled with it: the status table shows it.
                assert scale_up.metrics is not None
                assert scale_up.metrics.ttft_p95_s is not None
                assert scale_up.metrics.ttft_p95_s > 0.005
                # The new engine joins the router once healthy.
                step_until(
                    stack, lambda: len(router_addresses(fleet)) == 2, 60, "2 router addresses"
                )
                rest = LOAD_S - (time.monotonic() - started)
                if rest > 0:
                    step_until(
                        stack, lambda: time.monotonic() - started >= LOAD_S, rest + 5, "load"
                    )
            finally:
                stop.set()
            served = sum(w.result() for w in workers)
        load_stopped = time.monotonic()
        assert served > 0
        assert errors == []
        table = stack.status_table()
        # The last scale has its own column; the decision column says what holds it now.
        assert "1 -> 2, " in table.splitlines()[1]

        down = step_until(
            stack,
            lambda: (
                len(fleet.role_replicas("small", "unified")) == 1
                and stack.actuator.decisions[-1].replicas == 1
            ),
            60,
            "a scale-down",
        )
        when, scale_down = next((t, d) for t, d in down if d.replicas < d.current_replicas)
        assert when - load_stopped >= SCALE_DOWN_WINDOW_S, scale_down.reason
        assert "idle" in scale_down.reason, scale_down.reason
        assert scale_down.reason.endswith("2 -> 1") or "2 -> 1 (" in scale_down.reason
        # Before it, the lull was watched, not acted on at once.
        holds = [d for t, d in down if t < when]
        assert holds
        assert all(d.replicas == 2 for d in holds)
        assert len(router_addresses(fleet)) == 1
        assert stack.actuator.roles[("small", "unified")].desired == 1
    finally:
        stop.set()
