"""The control API against a real one-tier fleet, through the autoscaler's own client.

The fleet runs one reference engine and the router; the control API is served on a free
loopback port. The client (``FleetClient``/``FleetActuator``) is the one ``fleetpilot
autoscaler`` uses, so these tests hold both sides to one contract.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest

from fleetpilot.api import InferenceService, parse_service
from fleetpilot.autoscaler.loop import observed_cold_start, tick
from fleetpilot.autoscaler.model import Metrics
from fleetpilot.autoscaler.remote import FleetActuator, FleetClient, FleetError, RoleState
from fleetpilot.runtime.autoscale import LocalActuator, capped_service
from fleetpilot.runtime.control import ControlServer
from fleetpilot.runtime.local import LocalFleet
from fleetpilot.runtime.processes import free_port
from fleetpilot.testing.polling import eventually
from tests.factories import make_local_manifest

SERVICE = make_local_manifest("ctl", replicas={"min": 1, "max": 8}, ttft_p95="50ms")
MAX_REPLICAS = 2
# An engine process imports torch and builds its model before /health answers: seconds on a
# quiet machine, much longer on a busy two-core one. A bound for a hang, not a speed check.
READY_TIMEOUT_S = 180.0


class Fleet:
    def __init__(self, fleet: LocalFleet, actuator: LocalActuator, server: ControlServer):
        self.fleet = fleet
        self.actuator = actuator
        self.server = server

    def wait_ready(self, replicas: int, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Poll until the role has exactly ``replicas`` engines, all serving."""

        def state() -> RoleState:
            found = self.actuator.role_state("small", "unified")
            assert found is not None
            return found

        eventually(
            f"{replicas} replicas, all ready",
            state,
            timeout_s,
            until=lambda s: s.ready == replicas == s.replicas,
            interval=0.2,
        )


@pytest.fixture(scope="module")
def service() -> InferenceService:
    return parse_service(SERVICE)


@pytest.fixture(scope="module")
def running(service: InferenceService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = LocalFleet(service, tmp_path_factory.mktemp("fleet"), 0)
    actuator = LocalActuator(fleet)
    server = ControlServer(
        actuator, capped_service(service, MAX_REPLICAS), max_replicas=MAX_REPLICAS
    )
    try:
        fleet.start()
        server.start()
        yield Fleet(fleet, actuator, server)
    finally:
        server.stop()
        actuator.close()
        fleet.stop()
        assert fleet.leftovers() == []


@pytest.fixture
def fleet(running: Fleet) -> Iterator[Fleet]:
    """The running fleet, put back to one replica after each test."""
    yield running
    running.actuator.scale("small", "unified", 1)
    running.wait_ready(1)


@pytest.fixture
def client(fleet: Fleet) -> Iterator[FleetClient]:
    with FleetClient(fleet.server.url) as api:
        yield api


def test_the_fleet_reports_its_capped_service_and_its_roles(client: FleetClient) -> None:
    """GET /fleet gives the autoscaler the service with its replica bounds capped to what this
    machine runs (2, not the spec's 8) and every role's replicas, readiness and addresses."""
    service, roles, prometheus = client.fleet()
    assert service.name == "ctl"
    tier = service.spec.tiers[0]
    assert tier.serving.replicas is not None
    assert tier.serving.replicas.max == MAX_REPLICAS  # what this machine runs, not 8
    assert prometheus is None
    (role,) = roles
    assert (role.tier, role.role, role.replicas, role.ready) == ("small", "unified", 1, 1)
    assert len(role.addresses) == 1
    assert client.addresses("small", "unified") == list(role.addresses)
    # With a status as under the operator: the engine's start, launch to joining the router,
    # is the role's observed cold start the autoscaler reads.
    assert service.status is not None
    (role_status,) = service.status.tiers[0].roles
    assert (role_status.role, role_status.replicas, role_status.ready) == ("unified", 1, 1)
    assert role_status.cold_start is not None
    assert role_status.cold_start.count == 1
    assert observed_cold_start(service, "small", "unified") is not None


def test_an_unknown_role_is_none_and_cannot_be_scaled(client: FleetClient) -> None:
    """A tier or role the service does not run is a 404: reading it gives None, scaling it is
    refused by name."""
    assert client.role("small", "decode") is None
    assert client.role("nope", "unified") is None
    with pytest.raises(FleetError, match="404 no role 'decode' in tier 'small'"):
        client.scale("small", "decode", 1)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"replicas": 3}, "replicas: 3 is outside 0..2"),
        ({"replicas": -1}, "replicas: -1 is outside 0..2"),
        ({"replicas": "2"}, "replicas: expected an integer"),
        ({"replicas": True}, "replicas: expected an integer"),
        ({}, "replicas: expected an integer"),
    ],
)
def test_a_bad_scale_request_is_refused_naming_the_field(
    fleet: Fleet, body: object, message: str
) -> None:
    """A scale outside 0..--max-replicas-per-role, or not an integer, is a 400 naming
    ``replicas``, and no engine is started or stopped."""
    url = f"{fleet.server.url}/fleet/tiers/small/roles/unified"
    response = httpx.put(url, json=body, trust_env=False)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"]
    assert error["param"] == "replicas"
    assert len(fleet.fleet.role_replicas("small", "unified")) == 1  # nothing changed


def test_a_body_that_is_not_json_is_a_400(fleet: Fleet) -> None:
    """A body that does not parse is the client's error (400), not a failed handler."""
    response = httpx.post(f"{fleet.server.url}/fleet/decisions", content=b"{nope", trust_env=False)
    assert response.status_code == 400
    assert "not JSON" in response.json()["error"]["message"]


def test_scaling_through_the_api_starts_an_engine_that_outlives_the_request(
    fleet: Fleet, client: FleetClient
) -> None:
    """An engine started for a control API request outlives the request's thread (the
    parent-death signal is tied to the forking thread: engines fork from a long-lived one)."""
    state = client.scale("small", "unified", 2)
    assert (state.replicas, state.ready) == (2, 1)  # started, not yet serving
    # The request's thread has ended (the death signal, had the engine been tied to it, is
    # sent then); only after that does the new engine load its model and answer /health.
    join_request_threads()
    fleet.wait_ready(2)
    assert all(r.child and r.child.alive() for r in fleet.fleet.replicas)
    newest = max(fleet.fleet.role_replicas("small", "unified"), key=lambda r: r.index)
    state = client.scale("small", "unified", 1)
    assert state.replicas == 1
    assert newest.address not in state.addresses  # the newest one is stopped


def join_request_threads(timeout_s: float = 30.0) -> None:
    """Wait until every thread the control API's HTTP server started for a request ended.
    Polled, not joined: a thread just created for another request (listed, not yet started)
    cannot be joined."""
    eventually(
        "no request thread left",
        lambda: [
            t.name
            for t in threading.enumerate()
            if t.name.endswith("(process_request_thread)") and t.is_alive()
        ],
        timeout_s,
        until=lambda busy: not busy,
        interval=0.05,
    )


class BurstSource:
    """A metrics source reporting a TTFT p95 far above the objective, with enough samples."""

    def observe(
        self, service: str, tier: str, role: str, window: timedelta, *, namespace: str | None
    ) -> Metrics:
        return Metrics(
            ttft_p95_s=0.2,
            ttft_samples=100,
            kv_cache_usage_frac=0.1,
            waiting_requests=0,
            running_requests=4,
            reporting_engines=1,
            prefix_hit_rate_frac=0.5,
            data_age_s=0.5,
        )


def test_a_tick_through_the_api_scales_and_records_the_reason(
    fleet: Fleet, client: FleetClient
) -> None:
    """One policy tick through the autoscaler's own client scales the role up (TTFT p95 over
    its objective) and the fleet keeps the decision's reason and what it saw for the table."""
    service, _, _ = client.fleet()
    decisions = tick(service, BurstSource(), FleetActuator(client), {})
    (decision,) = decisions
    assert decision.replicas == 2
    assert len(fleet.fleet.role_replicas("small", "unified")) == 2
    record = fleet.actuator.roles[("small", "unified")]
    assert record.desired == 2
    assert "ttft p95 200ms > slo 50ms: 1 -> 2" in record.last_scale_reason
    assert record.metrics is not None
    assert record.metrics.ttft_p95_s == pytest.approx(0.2)
    assert record.metrics.prefix_hit_rate_frac == pytest.approx(0.5)
    fleet.wait_ready(2)


def test_a_malformed_decision_is_refused_and_not_recorded(fleet: Fleet) -> None:
    """A decision missing its fields is a 400 and leaves the status table's records untouched."""
    before = len(fleet.actuator.decisions)
    response = httpx.post(
        f"{fleet.server.url}/fleet/decisions",
        json={"decisions": [{"tier": "small", "role": "unified"}]},
        trust_env=False,
    )
    assert response.status_code == 400
    assert "decisions: malformed" in response.json()["error"]["message"]
    assert len(fleet.actuator.decisions) == before


def run_autoscaler(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetpilot", "autoscaler", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_autoscaler_command_ticks_once_against_the_fleet(fleet: Fleet) -> None:
    """``fleetpilot autoscaler --fleet URL --once`` (the process ``fleetpilot up`` runs) reads
    the fleet, reads the engines' /metrics without Prometheus, and holds an idle role."""
    before = len(fleet.actuator.decisions)
    result = run_autoscaler("--fleet", fleet.server.url, "--once")
    assert result.returncode == 0, result.stderr
    assert "reading the engines' /metrics directly" in result.stderr
    recorded = fleet.actuator.decisions[before:]
    assert [(d.tier, d.role) for d in recorded] == [("small", "unified")]
    # One look at an idle engine is no data for a decision: it holds.
    assert recorded[0].replicas == 1
    assert len(fleet.fleet.role_replicas("small", "unified")) == 1


def test_the_autoscaler_command_gives_up_on_a_fleet_that_never_answers() -> None:
    """The autoscaler exits 1, saying why, when the control API never answers within
    --fleet-timeout, instead of waiting forever."""
    result = run_autoscaler(
        "--fleet", f"http://127.0.0.1:{free_port()}", "--fleet-timeout", "1", timeout=30
    )
    assert result.returncode == 1
    assert "fleet not answering" in result.stderr


def test_decisions_survive_the_wire(fleet: Fleet, client: FleetClient) -> None:
    """What the fleet records of a decision (tier, role, reason, metrics) is what the
    autoscaler decided: nothing is lost in the JSON round trip."""
    service, _, _ = client.fleet()
    (decision,) = tick(service, BurstSource(), FleetActuator(client), {})
    mirrored = fleet.actuator.decisions[-1]
    assert (mirrored.tier, mirrored.role, mirrored.reason) == (
        decision.tier,
        decision.role,
        decision.reason,
    )
    assert decision.observation is not None
    assert mirrored.metrics == decision.observation.metrics
    fleet.wait_ready(2)
