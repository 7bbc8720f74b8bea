"""The autoscaler's side of a local fleet's control API (``fleetpilot up`` serves it).

``fleetpilot up`` owns the engine processes; ``fleetpilot autoscaler --fleet URL`` runs apart
and moves them through a small JSON API on loopback:

- ``GET /fleet``: the (capped) service manifest, every role's replicas, the Prometheus URL;
- ``GET /fleet/tiers/{tier}/roles/{role}``: one role (replicas, ready, serving addresses);
- ``PUT /fleet/tiers/{tier}/roles/{role}`` ``{"replicas": n}``: scale one role;
- ``POST /fleet/decisions`` ``{"decisions": [...], "condition": {...}}``: record a tick.

:class:`FleetActuator` is the :class:`~fleetpilot.autoscaler.actuator.Actuator` over it, and
:meth:`FleetClient.addresses` the address book :class:`~fleetpilot.autoscaler.direct.
EngineMetricsSource` scrapes when there is no Prometheus. The wire form of a decision is here
too (:func:`decision_to_wire`, :func:`decision_from_wire`), so both sides read one definition.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx

from fleetpilot.api import InferenceService, parse_service
from fleetpilot.api.status import Condition
from fleetpilot.autoscaler.actuator import AutoscalerMetrics, Replicas
from fleetpilot.autoscaler.model import DataProblem, Decision, Metrics

log = logging.getLogger(__name__)

# Loopback answers in milliseconds; a fleet busy starting an engine still answers within this.
DEFAULT_TIMEOUT_S = 10.0


class FleetError(RuntimeError):
    """The fleet's control API could not be reached (``status`` None) or refused a request
    (``status`` the HTTP status)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RoleState:
    """One role of a local fleet as its control API reports it."""

    tier: str
    role: str
    replicas: int  # engine processes started (ready or not)
    ready: int  # answering /health and listed in the router's config
    addresses: tuple[str, ...]  # host:port of the ready ones

    def to_wire(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "role": self.role,
            "replicas": self.replicas,
            "ready": self.ready,
            "addresses": list(self.addresses),
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> RoleState:
        return cls(
            tier=str(data["tier"]),
            role=str(data["role"]),
            replicas=int(data["replicas"]),
            ready=int(data["ready"]),
            addresses=tuple(str(a) for a in data.get("addresses", ())),
        )


@dataclass(frozen=True)
class RecordedDecision:
    """A decision as the fleet records it: what the status table and the log show."""

    tier: str
    role: str
    current_replicas: int
    replicas: int
    reason: str
    dry_run: bool = False
    metrics: Metrics | None = None

    @property
    def changed(self) -> bool:
        return self.replicas != self.current_replicas


def metrics_to_wire(metrics: Metrics) -> dict[str, Any]:
    wire = dataclasses.asdict(metrics)
    wire["problem"] = metrics.problem.value if metrics.problem is not None else None
    return wire


def metrics_from_wire(data: Mapping[str, Any]) -> Metrics:
    known = {f.name for f in dataclasses.fields(Metrics)}
    values = {k: v for k, v in data.items() if k in known}
    problem = values.pop("problem", None)
    return Metrics(**values, problem=DataProblem(problem) if problem else None)


def decision_to_wire(decision: Decision) -> dict[str, Any]:
    observation = decision.observation
    return {
        "tier": decision.tier,
        "role": decision.role,
        "currentReplicas": decision.current_replicas,
        "replicas": decision.replicas,
        "reason": decision.reason,
        "dryRun": decision.dry_run,
        "metrics": metrics_to_wire(observation.metrics) if observation is not None else None,
    }


def decision_from_wire(data: Mapping[str, Any]) -> RecordedDecision:
    """Raises KeyError/ValueError/TypeError on a malformed decision (the server answers 400)."""
    metrics = data.get("metrics")
    return RecordedDecision(
        tier=str(data["tier"]),
        role=str(data["role"]),
        current_replicas=int(data["currentReplicas"]),
        replicas=int(data["replicas"]),
        reason=str(data["reason"]),
        dry_run=bool(data.get("dryRun", False)),
        metrics=metrics_from_wire(metrics) if isinstance(metrics, Mapping) else None,
    )


def _role_path(tier: str, role: str) -> str:
    return f"/fleet/tiers/{quote(tier, safe='')}/roles/{quote(role, safe='')}"


class FleetClient:
    """HTTP client of one fleet's control API; every failure is a :class:`FleetError`."""

    def __init__(self, url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.router_address: str | None = None  # host:port, as of the last fleet()
        # Loopback: never through a proxy from the environment.
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, body: object = None) -> Any:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise FleetError(f"{method} {self.url}{path}: {type(exc).__name__} {exc}") from exc
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:300]
            raise FleetError(
                f"{method} {self.url}{path}: {response.status_code} {message}",
                response.status_code,
            )
        return response.json()

    def fleet(self) -> tuple[InferenceService, list[RoleState], str | None]:
        """The service (as the fleet runs it), its roles, and its Prometheus URL if any."""
        body = self._call("GET", "/fleet")
        service = parse_service(body["service"], f"{self.url}/fleet")
        roles = [RoleState.from_wire(r) for r in body["roles"]]
        self.router_address = body.get("router")
        return service, roles, body.get("prometheusUrl")

    def role(self, tier: str, role: str) -> RoleState | None:
        """One role, or None when the fleet has no such tier or role."""
        try:
            return RoleState.from_wire(self._call("GET", _role_path(tier, role)))
        except FleetError as exc:
            if exc.status == 404:
                return None
            raise

    def scale(self, tier: str, role: str, replicas: int) -> RoleState:
        body = self._call("PUT", _role_path(tier, role), {"replicas": replicas})
        return RoleState.from_wire(body)

    def record(self, decisions: Sequence[Decision], condition: Condition) -> None:
        self._call(
            "POST",
            "/fleet/decisions",
            {
                "decisions": [decision_to_wire(d) for d in decisions],
                "condition": condition.to_wire(),
            },
        )

    def addresses(self, tier: str, role: str) -> list[str]:
        """The role's serving engine addresses (an ``AddressBook`` for the direct source)."""
        state = self.role(tier, role)
        return list(state.addresses) if state is not None else []


class FleetActuator:
    """:class:`~fleetpilot.autoscaler.actuator.Actuator` over a local fleet's control API.

    Decisions are recorded in the fleet (its status table) and in the autoscaler metrics.
    """

    def __init__(self, client: FleetClient, metrics: AutoscalerMetrics | None = None) -> None:
        self.client = client
        self.metrics = metrics

    def current(self, service: InferenceService, tier: str, role: str) -> Replicas | None:
        state = self.client.role(tier, role)
        return None if state is None else Replicas(current=state.replicas, ready=state.ready)

    def scale(self, service: InferenceService, tier: str, role: str, replicas: int) -> None:
        self.client.scale(tier, role, replicas)

    def record(
        self,
        service: InferenceService,
        decisions: Sequence[Decision],
        condition: Condition,
        now: datetime,
    ) -> None:
        if self.metrics is not None:
            for decision in decisions:
                self.metrics.observe(service, decision)
        self.client.record(decisions, condition)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FleetActuator",
    "FleetClient",
    "FleetError",
    "RecordedDecision",
    "RoleState",
    "decision_from_wire",
    "decision_to_wire",
    "metrics_from_wire",
    "metrics_to_wire",
]
