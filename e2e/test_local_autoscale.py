"""The local autoscaler end to end: load through the router scales a role up, a lull down.

A one-tier service whose TTFT objective (5 ms) a handful of concurrent requests on a CPU
breaks. The autoscaler reads the engines' /metrics directly (no Prometheus) and starts and
stops engine processes; the router's config follows. The knobs are the service's own: a 1 s
interval and a 10 s window make decisions come fast enough for a test, and the default
min_samples (10) is reached within a second of load, so no policy default needs changing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from fleetpilot.api import load_services
from fleetpilot.autoscaler.policy import Decision, Direction, ReasonKind
from fleetpilot.runtime.autoscale import LocalAutoscaler
from fleetpilot.runtime.local import LocalFleet
from fleetpilot.runtime.processes import free_port, port_in_use

SERVICE = """\
apiVersion: fleetpilot.dev/v1alpha1
kind: InferenceService
metadata: {name: auto, namespace: default}
spec:
  monitoring: {scrapeInterval: 1s}
  tiers:
    - name: small
      model: {name: Qwen/Qwen2.5-0.5B-Instruct, servedName: small-model, maxModelLen: 512}
      engine: {maxNumSeqs: 16}
      serving:
        replicas: {min: 1, max: 2}
      autoscaling:
        interval: 1s
        window: 10s
        slo: {ttftP95: 5ms}
        scaleUp: {stabilization: 0s}
        scaleDown: {stabilization: 5s}
"""
SCALE_DOWN_WINDOW_S = 5.0
LOAD_S = 15.0
CONCURRENCY = 8
# A long-ish prompt makes prefill, hence TTFT, cost something even for the tiny model.
PROMPT = "Summarize the following text in one sentence. " + "The quick brown fox jumps. " * 12


def router_addresses(fleet: LocalFleet) -> list[str]:
    config = yaml.safe_load(fleet.config_path.read_text())
    return [
        a for tier in config["tiers"] for group in tier["endpoints"] for a in group["addresses"]
    ]


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


def free_port_pair() -> int:
    """A router port whose next port (the first engine's) is free too."""
    for _ in range(100):
        base = free_port()
        if base < 65534 and not port_in_use(base + 1):
            return base
    raise RuntimeError("no two free consecutive ports")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[LocalFleet]:
    path = tmp_path / "service.yaml"
    path.write_text(SERVICE)
    (service,) = load_services(path)
    local = LocalFleet(service, tmp_path / "fleet", free_port_pair())
    try:
        local.start()
        yield local
    finally:
        local.stop()
        assert local.leftovers() == []


def step_until(
    autoscaler: LocalAutoscaler, done: Callable[[], bool], timeout_s: float, what: str
) -> list[tuple[float, Decision]]:
    """Step the autoscaler (in this thread: it starts the engines) until ``done()``."""
    seen: list[tuple[float, Decision]] = []
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            reasons = "\n".join(d.reason for _, d in seen[-5:])
            raise AssertionError(f"timed out waiting for {what}; last reasons:\n{reasons}")
        seen.extend((time.monotonic(), d) for d in autoscaler.step())
        time.sleep(0.1)
    return seen


def test_load_scales_up_on_ttft_and_a_lull_scales_down_after_the_window(
    fleet: LocalFleet,
) -> None:
    autoscaler = LocalAutoscaler(fleet, max_replicas_per_role=2, say=print)
    stop = threading.Event()
    errors: list[str] = []
    url = fleet.endpoint
    try:
        with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
            started = time.monotonic()
            workers = [pool.submit(load, url, stop, errors) for _ in range(CONCURRENCY)]
            try:
                up = step_until(
                    autoscaler,
                    lambda: len(fleet.role_replicas("small", "unified")) == 2,
                    LOAD_S + 15,
                    "a scale-up",
                )
                scale_up = next(d for _, d in up if d.direction is Direction.UP)
                assert scale_up.reason_kind is ReasonKind.TTFT, scale_up.reason
                assert "ttft p95" in scale_up.reason
                assert scale_up.reason.endswith("1 -> 2") or "1 -> 2 (" in scale_up.reason
                # The new engine joins the router once healthy.
                step_until(
                    autoscaler, lambda: len(router_addresses(fleet)) == 2, 60, "2 router addresses"
                )
                rest = LOAD_S - (time.monotonic() - started)
                if rest > 0:
                    step_until(
                        autoscaler, lambda: time.monotonic() - started >= LOAD_S, rest + 5, "load"
                    )
            finally:
                stop.set()
            served = sum(w.result() for w in workers)
        load_stopped = time.monotonic()
        assert served > 0
        assert errors == []

        down = step_until(
            autoscaler,
            lambda: len(fleet.role_replicas("small", "unified")) == 1,
            60,
            "a scale-down",
        )
        when, scale_down = next((t, d) for t, d in down if d.direction is Direction.DOWN)
        assert when - load_stopped >= SCALE_DOWN_WINDOW_S, scale_down.reason
        assert scale_down.reason_kind is ReasonKind.IDLE, scale_down.reason
        # Before it, the lull was watched, not acted on at once.
        holds = [d for t, d in down if t < when]
        assert holds
        assert all(d.replicas == 2 for d in holds)
        assert len(router_addresses(fleet)) == 1
        assert autoscaler.actuator.status_columns()[("small", "unified")][0] == 1
    finally:
        stop.set()
        autoscaler.close()
