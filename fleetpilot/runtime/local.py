"""A service realized as local processes on loopback: reference engines and the router.

The same planner code decides what runs (tiers, roles, initial replicas, each role's engine
launch, the router's config); only the realization differs from Kubernetes: each engine
replica is a CPU reference-engine process with a tiny random model, started from its role's
launch (:mod:`fleetpilot.runtime.reference_argv` says what of it a CPU keeps), and the router
finds them through static addresses written into its config file. GPU, image and resource
settings of the service are ignored.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from fleetpilot.api import InferenceService, ResolvedRole, RoleName
from fleetpilot.api.router_config import ROUTER_CONFIG_FILE, RouterConfig
from fleetpilot.engine.vllm_args import launch_for
from fleetpilot.operator.router_objects import router_config
from fleetpilot.runtime.processes import (
    Child,
    ChildFailedError,
    Supervisor,
    free_port,
    port_in_use,
    require_free_ports,
)
from fleetpilot.runtime.reference_argv import CPU_MAX_NUM_SEQS, reference_argv

HOST = "127.0.0.1"
# A CPU runs a handful of engines at most: more replicas than this per role are not started.
DEFAULT_MAX_REPLICAS_PER_ROLE = 2


@dataclass
class Replica:
    """One engine process of one role of one tier."""

    tier: str
    role: RoleName
    index: int
    port: int
    argv: list[str]
    child: Child | None = None
    # In the router's config: set once the engine answered /health, so the router never
    # sends a request to an engine still loading (a scaled-up replica starts unlisted).
    serving: bool = False

    @property
    def name(self) -> str:
        """``small/unified#0``: how ports, logs and reports name it."""
        return f"{self.tier}/{self.role}#{self.index}"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"


@dataclass(frozen=True)
class StatusRow:
    """What ``fleetpilot up`` shows per tier and role."""

    tier: str
    role: str
    replicas: int
    alive: int
    healthy: int
    ports: list[int] = field(default_factory=list)


def engine_argv(role: ResolvedRole, port: int, python: str = sys.executable) -> list[str]:
    """The reference-engine command line for one replica of ``role`` on a CPU: the planner's
    launch of the role (what a pod runs), on this host and port (see reference_argv)."""
    return reference_argv(replace(launch_for(role), port=port), HOST, python)


def _log_name(name: str) -> str:
    return name.replace("/", "-").replace("#", "-")


class LocalFleet:
    """Engines per (tier, role) and the router, as supervised processes; ``stop()`` ends all."""

    def __init__(
        self,
        service: InferenceService,
        workdir: Path,
        base_port: int = 8000,
        *,
        max_replicas_per_role: int = DEFAULT_MAX_REPLICAS_PER_ROLE,
        health_timeout_s: float = 120.0,
        python: str = sys.executable,
    ) -> None:
        if max_replicas_per_role < 1:
            raise ValueError("max_replicas_per_role must be at least 1")
        self.service = service
        self.workdir = workdir
        # Port 0: every process on its own free port (tests, the demo), instead of the block
        # after base_port, which another process may hold in part.
        taken: set[int] = set()

        def next_port(previous: int) -> int:
            if base_port != 0:
                return previous + 1
            port = free_port(HOST)
            while port in taken:
                port = free_port(HOST)
            taken.add(port)
            return port

        self.router_port = next_port(-1) if base_port == 0 else base_port
        self.health_timeout_s = health_timeout_s
        self.python = python
        self.supervisor = Supervisor(workdir / "logs")
        self.replicas: list[Replica] = []
        port = base_port
        for tier in service.spec.tiers:
            for role in tier.roles():
                count = min(role.replicas.start, max_replicas_per_role)
                for i in range(count):
                    port = next_port(port)
                    argv = engine_argv(role, port, python)
                    self.replicas.append(Replica(tier.name, role.name, i, port, argv))
        self.router: Child | None = None

    @property
    def endpoint(self) -> str:
        """The OpenAI-compatible base URL clients use."""
        return f"http://{HOST}:{self.router_port}/v1"

    @property
    def config_path(self) -> Path:
        return self.workdir / ROUTER_CONFIG_FILE

    def ports(self) -> dict[str, int]:
        """Every port the fleet listens on, by what listens there."""
        return {"router": self.router_port, **{r.name: r.port for r in self.replicas}}

    def router_config(self) -> RouterConfig:
        """The planner's router config with each group's static engine addresses."""
        config = router_config(self.service)
        tiers = []
        for tier in config.tiers:
            groups = [
                group.model_copy(
                    update={
                        "addresses": [
                            r.address
                            for r in self.replicas
                            if r.tier == tier.name and r.role == group.role and r.serving
                        ],
                        # The engines run with the CPU batch limit: saturation comes sooner.
                        "max_num_seqs": min(group.max_num_seqs, CPU_MAX_NUM_SEQS),
                    }
                )
                for group in tier.endpoints
            ]
            tiers.append(tier.model_copy(update={"endpoints": groups}))
        return config.model_copy(update={"port": self.router_port, "tiers": tiers})

    def start(self) -> None:
        """Start engines, wait for them, then the router; on any failure stop what started.

        Raises PortInUseError (before anything starts) or ChildFailedError (with a log tail).
        """
        require_free_ports(self.ports(), HOST)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for replica in self.replicas:
                replica.child = self.supervisor.start(
                    _log_name(replica.name),
                    replica.argv,
                    health_url=f"http://{replica.address}/health",
                    env={"PYTHONUNBUFFERED": "1"},
                )
            for replica in self.replicas:
                assert replica.child is not None
                self.supervisor.wait_healthy(replica.child, self.health_timeout_s)
                replica.serving = True
            self.write_router_config()
            router_argv = [
                *(self.python, "-m", "fleetpilot", "router"),
                *("--config", str(self.config_path), "--host", HOST),
                *("--port", str(self.router_port), "--discovery", "static"),
                *("--log-format", "plain", "--log-level", "warning"),
                # A local fleet's addresses are loopback ports its user can see anyway; the
                # demo and e2e tests read which replica served from the route header.
                "--debug-route-header",
            ]
            self.router = self.supervisor.start(
                "router",
                router_argv,
                health_url=f"http://{HOST}:{self.router_port}/health",
                env={"PYTHONUNBUFFERED": "1"},
            )
            self.supervisor.wait_healthy(self.router, self.health_timeout_s)
        except BaseException:
            self.stop()
            raise

    def supervise_once(self) -> list[str]:
        """Restart every child that exited unasked; returns one report per crash (log tail).

        Raises ChildFailedError when a restarted child does not become healthy again.
        """
        reports = []
        for child in self.supervisor.crashed():
            code = child.popen.returncode if child.popen is not None else "?"
            reports.append(
                f"{child.name} exited with code {code}; restarting. Last lines of "
                f"{child.log_path}:\n{child.tail(10)}"
            )
            self.supervisor.restart(child)
            self.supervisor.wait_healthy(child, self.health_timeout_s)
        return reports

    def write_router_config(self) -> None:
        """Write the router's config atomically: the router polls the file and must never
        read it half-written (a temporary file in the same directory, then a rename)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(self.router_config().to_wire(), sort_keys=False)
        fd, tmp = tempfile.mkstemp(prefix=".router-", suffix=".yaml", dir=self.workdir)
        try:
            with os.fdopen(fd, "w") as out:
                out.write(text)
            os.replace(tmp, self.config_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def role_replicas(self, tier: str, role: str) -> list[Replica]:
        """The replicas of one role, oldest first."""
        return [r for r in self.replicas if r.tier == tier and r.role == role]

    def add_replica(self, tier: str, role: str) -> Replica:
        """Start one more engine of ``tier``'s ``role`` on a free port, without waiting for it.

        It joins the router's config once healthy (see :meth:`refresh_serving`): an engine
        loading its model must not be sent requests. Raises KeyError for an unknown tier or a
        role the tier does not run.
        """
        spec = next((t for t in self.service.spec.tiers if t.name == tier), None)
        if spec is None:
            raise KeyError(f"no tier {tier!r}")
        resolved = spec.role(role)
        if resolved is None:
            raise KeyError(f"no role {role!r} in tier {tier!r}")
        taken = set(self.ports().values())
        port = free_port(HOST)
        while port in taken or port_in_use(port, HOST):
            port = free_port(HOST)
        index = max((r.index for r in self.role_replicas(tier, role)), default=-1) + 1
        argv = engine_argv(resolved, port, self.python)
        replica = Replica(tier, resolved.name, index, port, argv)
        replica.child = self.supervisor.start(
            _log_name(replica.name),
            replica.argv,
            health_url=f"http://{replica.address}/health",
            env={"PYTHONUNBUFFERED": "1"},
        )
        self.replicas.append(replica)
        return replica

    def remove_replica(self, tier: str, role: str, grace_s: float = 5.0) -> Replica | None:
        """Stop the newest engine of a role (the one with the least warm cache); None if the
        role has none. The router stops listing it before it is stopped."""
        members = self.role_replicas(tier, role)
        if not members:
            return None
        victim = max(members, key=lambda r: r.index)
        self.replicas.remove(victim)
        if victim.serving:
            victim.serving = False
            self.write_router_config()
        if victim.child is not None:
            self.supervisor.stop(victim.child, grace_s)
        return victim

    def refresh_serving(self) -> bool:
        """List newly healthy engines in the router's config; True when it was rewritten."""
        joined = [
            r
            for r in self.replicas
            if not r.serving and r.child is not None and r.child.alive() and r.child.healthy(0.5)
        ]
        for replica in joined:
            replica.serving = True
        if joined:
            self.write_router_config()
        return bool(joined)

    def serving_addresses(self, tier: str, role: str) -> list[str]:
        """The addresses the router sends this role's requests to now."""
        return [r.address for r in self.role_replicas(tier, role) if r.serving]

    def status_rows(self) -> list[StatusRow]:
        """Per tier and role: replicas planned, alive and answering /health, their ports."""
        rows: list[StatusRow] = []
        # Every role of the service, in spec order: a role scaled to zero shows as 0.
        groups: dict[tuple[str, str], list[Replica]] = {
            (tier.name, role): [] for tier in self.service.spec.tiers for role in tier.role_names
        }
        for replica in self.replicas:
            groups.setdefault((replica.tier, replica.role), []).append(replica)
        for (tier, role), members in groups.items():
            children = [r.child for r in members if r.child is not None]
            rows.append(
                StatusRow(
                    tier=tier,
                    role=role,
                    replicas=len(members),
                    alive=sum(c.alive() for c in children),
                    healthy=sum(c.healthy(0.5) for c in children),
                    ports=[r.port for r in members],
                )
            )
        return rows

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the router, then the engines; nothing of the fleet is left running."""
        self.supervisor.stop_all(grace_s)

    def leftovers(self) -> list[int]:
        return self.supervisor.leftovers()

    def __enter__(self) -> LocalFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = [
    "DEFAULT_MAX_REPLICAS_PER_ROLE",
    "ChildFailedError",
    "LocalFleet",
    "Replica",
    "StatusRow",
    "engine_argv",
]
