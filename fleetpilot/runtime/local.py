"""A service realized as local processes on loopback: engines and the router.

The same planner code decides what runs (tiers, roles, initial replicas, each role's engine
launch, the router's config); only the realization differs from Kubernetes: each engine
replica is a process its backend (:mod:`fleetpilot.runtime.engines`) starts from its role's
launch - by default a CPU reference engine with a tiny random model
(:mod:`fleetpilot.engine.reference_launch` says what of the launch a CPU keeps), or ``vllm
serve`` on a GPU machine - publishing its KV events on two ports of its own, and the router
finds them through an endpoints file (address and KV-event ports of every serving engine)
beside its config file, and tokenizes with the engines' tokenizer to read those events. Image
and resource settings of the service are ignored.

A reference tier that reads a Hub checkpoint (``model.source.huggingface``, which a cluster's
``spec.modelCache`` Job downloads) is refused, not run: the local fleet downloads nothing and
has no model cache, and the seeded preset in its place would serve another model under the
checkpoint's name. ``fleetpilot up`` refuses the spec by its field before anything starts
(``planner.check_reference_tiers``); the engine mapping refuses such a launch too
(``reference_launch.reference_argv``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import yaml

from fleetpilot.api import InferenceService, ResolvedRole, RoleName
from fleetpilot.api.router_config import ROUTER_CONFIG_FILE, AuthConfig, Peers, RouterConfig
from fleetpilot.api.status import (
    ColdStart,
    ColdStartSample,
    InferenceServiceStatus,
    RoleStatus,
    TierStatus,
)
from fleetpilot.engine.adapter_client import AdapterClient
from fleetpilot.engine.vllm_args import launch_for
from fleetpilot.operator.adapter_loading import dynamic_tiers
from fleetpilot.operator.cold_start import cold_start
from fleetpilot.operator.router_auth import AUTH_DIR
from fleetpilot.operator.router_objects import router_config
from fleetpilot.runtime.engines import EngineBackend, ReferenceBackend
from fleetpilot.runtime.liveness import LivenessProbe
from fleetpilot.runtime.processes import (
    Child,
    ChildFailedError,
    Supervisor,
    free_port,
    port_in_use,
    require_free_ports,
    unresponsive_fields,
    unresponsive_report,
)

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
ENDPOINTS_FILE = "endpoints.yaml"
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
    # The KV-event publisher and replay ports; None: the engine publishes no events.
    kv_ports: tuple[int, int] | None = None
    # The ports the backend asked for besides these (EngineBackend.extra_ports).
    extra_ports: tuple[int, ...] = ()
    # When its engine process was last launched: its cold start ends when it joins the router.
    launched_at: datetime | None = None
    # Added to the fleet's environment for this engine (the backend's).
    env: dict[str, str] = field(default_factory=dict)

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
        backend: EngineBackend | None = None,
        cold_start_s: float = 0.0,
        step_delay_s: float = 0.0,
        say: Callable[[str], None] | None = None,
        auth_dir: Path | None = None,
        liveness: LivenessProbe | None = None,
        routers: int = 1,
    ) -> None:
        """``python`` runs the router (and the reference engines of the default backend);
        ``cold_start_s``: how long each engine of the default backend, those added later
        included, waits after loading before it answers /health (a GPU engine's start; its
        readiness wait is that much longer); ``step_delay_s``: how long each engine of the
        default backend sleeps after every busy step (a GPU's pace); ``say`` hears each
        engine's readiness while the fleet starts (k of N); ``auth_dir``: where the tenants'
        API keys of ``routing.auth`` are, as ``<secret>/<key>`` files (a cluster mounts the
        Secrets so); without it the local router admits every request; ``liveness``: how
        every child (engines, router, what else is started under this fleet's supervisor) is
        probed for liveness by :meth:`supervise_once` (the kubelet-like defaults);
        ``routers``: how many router replicas, each its own process with its own ports, peered
        over their metrics ports as a cluster's are over their headless Service
        (``routing.peers``). Clients spread their requests over :meth:`router_urls`."""
        if max_replicas_per_role < 1:
            raise ValueError("max_replicas_per_role must be at least 1")
        if routers < 1:
            raise ValueError("routers must be at least 1")
        if not (math.isfinite(cold_start_s) and cold_start_s >= 0):
            raise ValueError("cold_start_s must be a finite number of seconds, 0 or more")
        if not (math.isfinite(step_delay_s) and step_delay_s >= 0):
            raise ValueError("step_delay_s must be a finite number of seconds, 0 or more")
        if (cold_start_s > 0 or step_delay_s > 0) and backend is not None:
            raise ValueError(
                "cold_start_s and step_delay_s are the default (reference) backend's; "
                "not with a backend"
            )
        self.service = service
        self.workdir = workdir
        self.auth_dir = auth_dir
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

        # Every router replica's public port, and (below) its metrics port: the first router's
        # public port first of all (``base_port``), the rest after every engine's.
        self.router_ports = [next_port(-1) if base_port == 0 else base_port]
        self.router_metrics_ports: list[int] = []
        self.health_timeout_s = health_timeout_s
        self.liveness = liveness if liveness is not None else LivenessProbe()
        self.cold_start_s = cold_start_s
        self.say = say
        self.python = python
        self._auth_off_logged = False
        self.backend = (
            backend
            if backend is not None
            else ReferenceBackend(
                python,
                adapter_root=workdir / "adapters",
                cold_start_s=cold_start_s,
                step_delay_s=step_delay_s,
            )
        )
        self.supervisor = Supervisor(workdir / "logs")
        # Per lora.dynamic tier, the adapters each of its engines is given before it serves
        # (as the operator loads them into a cluster's Ready engines).
        self.run_time_adapters = dynamic_tiers(service)
        self._adapters = AdapterClient()
        self.replicas: list[Replica] = []
        # Per (tier, role): its observed cold starts (see _mark_serving).
        self.cold_starts: dict[tuple[str, str], ColdStart] = {}
        port = base_port
        planned: list[tuple[ResolvedRole, int, int]] = []
        for tier in service.spec.tiers:
            for role in tier.roles():
                count = min(role.replicas.start, max_replicas_per_role)
                for i in range(count):
                    port = next_port(port)
                    planned.append((role, i, port))
        # KV-event (and the backend's) ports after every engine's HTTP port, so those stay
        # consecutive.
        for role, i, engine_port in planned:
            more = []
            for _ in range(2 + len(self.backend.extra_ports)):
                port = next_port(port)
                more.append(port)
            self.replicas.append(
                self._replica(role, i, engine_port, (more[0], more[1]), tuple(more[2:]))
            )
        # The router's /metrics on a port of its own, as the operator plans it (after every
        # other, so the engines' ports stay where they were); further router replicas a public
        # and a metrics port each, after that.
        self.router_metrics_ports.append(port := next_port(port))
        for _ in range(routers - 1):
            self.router_ports.append(port := next_port(port))
            self.router_metrics_ports.append(port := next_port(port))
        self.routers: list[Child] = []

    def _replica(
        self,
        role: ResolvedRole,
        index: int,
        port: int,
        kv_ports: tuple[int, int],
        extra_ports: Sequence[int],
    ) -> Replica:
        """Replica ``index`` of ``role``: the planner's launch of the role (what a pod runs)
        on these ports, as the backend runs it."""
        events, replay = kv_ports
        launch = replace(launch_for(role), port=port, kv_events_port=events, kv_replay_port=replay)
        command = self.backend.command(launch, HOST, extra_ports)
        return Replica(
            role.tier.name,
            role.name,
            index,
            port,
            command.argv,
            kv_ports=kv_ports,
            extra_ports=tuple(extra_ports),
            env=command.env,
        )

    def _start_engine(self, replica: Replica) -> Child:
        replica.launched_at = datetime.now(UTC)
        return self.supervisor.start(
            _log_name(replica.name),
            replica.argv,
            health_url=f"http://{replica.address}/health",
            env={"PYTHONUNBUFFERED": "1", **replica.env},
        )

    @property
    def engine_timeout_s(self) -> float:
        """How long an engine may take to answer /health: the cold start on top."""
        return self.health_timeout_s + self.cold_start_s

    @property
    def router(self) -> Child | None:
        """The first router replica's process, once started."""
        return self.routers[0] if self.routers else None

    @property
    def router_port(self) -> int:
        """The first router replica's public port."""
        return self.router_ports[0]

    @property
    def router_metrics_port(self) -> int:
        """The first router replica's metrics port."""
        return self.router_metrics_ports[0]

    @property
    def endpoint(self) -> str:
        """The OpenAI-compatible base URL clients use (the first router replica's)."""
        return self.router_urls()[0]

    def router_urls(self) -> list[str]:
        """Every router replica's OpenAI-compatible base URL: what a client spreads its
        requests over, as a cluster's router Service spreads connections."""
        return [f"http://{HOST}:{port}/v1" for port in self.router_ports]

    @property
    def router_metrics_address(self) -> str:
        """``host:port`` of the router's metrics listener (its public port serves no
        /metrics, as in a cluster)."""
        return f"{HOST}:{self.router_metrics_port}"

    @property
    def config_path(self) -> Path:
        """The (first) router replica's config file."""
        return self.router_config_path(0)

    def router_config_path(self, index: int) -> Path:
        if index == 0:
            return self.workdir / ROUTER_CONFIG_FILE
        return self.workdir / f"router-{index}-{ROUTER_CONFIG_FILE}"

    @property
    def endpoints_path(self) -> Path:
        return self.workdir / ENDPOINTS_FILE

    def ports(self) -> dict[str, int]:
        """Every port the fleet listens on, by what listens there."""
        ports = {"router": self.router_port, "router metrics": self.router_metrics_port}
        for i, (port, metrics) in enumerate(
            zip(self.router_ports[1:], self.router_metrics_ports[1:], strict=True), 1
        ):
            ports[f"router-{i}"], ports[f"router-{i} metrics"] = port, metrics
        for r in self.replicas:
            ports[r.name] = r.port
            if r.kv_ports is not None:
                ports[f"{r.name} kv-events"], ports[f"{r.name} kv-replay"] = r.kv_ports
            for name, port in zip(self.backend.extra_ports, r.extra_ports, strict=True):
                ports[f"{r.name} {name}"] = port
        return ports

    def router_config(self, index: int = 0) -> RouterConfig:
        """The planner's router config for this machine's router replica ``index``: the
        engines' batch limit and tokenizer, no addresses (the endpoints file lists them), each
        tier's observed cold start from the fleet's own status (the router holds a request for
        a tier at zero that long, as in a cluster), and its peers' metrics addresses."""
        config = router_config(self.service.model_copy(update={"status": self.status()}))
        specs = {tier.name: tier for tier in self.service.spec.tiers}
        tiers = []
        for tier in config.tiers:
            # One local engine per replica, whatever its data-parallel ranks in a cluster.
            launch = launch_for(specs[tier.name].roles()[0])  # both roles run one engine
            groups = [
                group.model_copy(
                    update={
                        "max_num_seqs": self.backend.max_num_seqs(launch),
                        # Each local engine has KV-event ports of its own (the endpoints file).
                        "kv_events_port": None,
                        "kv_replay_port": None,
                        "data_parallel": 1,
                    }
                )
                for group in tier.endpoints
            ]
            tiers.append(
                tier.model_copy(
                    update={"endpoints": groups, "tokenizer": self.backend.router_tokenizer()}
                )
            )
        # No cluster DNS name to resolve for the peers here: their static addresses (every
        # replica's, this one's among them: it knows itself by its id), none for one router.
        peers = (
            Peers(addresses=[f"{HOST}:{port}" for port in self.router_metrics_ports])
            if len(self.router_ports) > 1
            else None
        )
        return config.model_copy(
            update={
                "port": self.router_ports[index],
                "metrics_port": self.router_metrics_ports[index],
                "tiers": tiers,
                "auth": self._local_auth(config),
                "peers": peers,
            }
        )

    def _local_auth(self, config: RouterConfig) -> AuthConfig | None:
        """The router's key files under ``auth_dir`` instead of the pod's Secret mounts; no
        auth without one (logged once)."""
        if config.auth is None:
            return None
        if self.auth_dir is None:
            if not self._auth_off_logged:
                log.warning(
                    "routing.auth: the local router admits every request "
                    "(give the keys as <secret>/<key> files under --auth-dir to check them)"
                )
                self._auth_off_logged = True
            return None
        tenants = [
            tenant.model_copy(
                update={
                    "key_files": [
                        str(self.auth_dir / Path(f).relative_to(AUTH_DIR)) for f in tenant.key_files
                    ]
                }
            )
            for tenant in config.auth.tenants
        ]
        return config.auth.model_copy(update={"tenants": tenants})

    def endpoints(self) -> dict[str, list[dict[str, object]]]:
        """The router's endpoints file: every serving engine's address and KV-event ports."""
        listed: list[dict[str, object]] = []
        for r in self.replicas:
            if not r.serving:
                continue
            item: dict[str, object] = {
                "tier": r.tier,
                "role": r.role.value,
                "address": r.address,
                "name": r.name,
            }
            if r.kv_ports is not None:
                item["kvEventsPort"], item["kvReplayPort"] = r.kv_ports
            listed.append(item)
        return {"endpoints": listed}

    def start(self) -> None:
        """Start engines, wait for them, then the router; on any failure stop what started.

        Raises PortInUseError (before anything starts) or ChildFailedError (with a log tail).
        """
        require_free_ports(self.ports(), HOST)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for replica in self.replicas:
                replica.child = self._start_engine(replica)
                if self.backend.one_at_a_time:
                    self.supervisor.wait_healthy(replica.child, self.engine_timeout_s)
            started = time.monotonic()
            for ready, replica in enumerate(self.replicas, 1):
                assert replica.child is not None
                self.supervisor.wait_healthy(replica.child, self.engine_timeout_s)
                errors = self.load_adapters(replica)
                if errors:
                    raise ChildFailedError(f"{replica.name}: " + "; ".join(errors))
                self._mark_serving(replica)
                if self.say is not None:
                    waited = time.monotonic() - started
                    self.say(
                        f"engines ready: {ready} of {len(self.replicas)} "
                        f"({replica.name}, {waited:.0f} s)"
                    )
            self.write_router_config()
            for index, port in enumerate(self.router_ports):
                router_argv = [
                    *(self.python, "-m", "fleetpilot", "router"),
                    *("--config", str(self.router_config_path(index)), "--host", HOST),
                    *("--port", str(port), "--discovery", "static"),
                    *("--endpoints-file", str(self.endpoints_path)),
                    *("--log-format", "plain", "--log-level", "warning"),
                    # A local fleet's addresses are loopback ports its user can see anyway;
                    # the demo and e2e tests read which replica served from the route header.
                    "--debug-route-header",
                ]
                self.routers.append(
                    self.supervisor.start(
                        "router" if index == 0 else f"router-{index}",
                        router_argv,
                        health_url=f"http://{HOST}:{port}/health",
                        env={"PYTHONUNBUFFERED": "1"},
                    )
                )
            for child in self.routers:
                self.supervisor.wait_healthy(child, self.health_timeout_s)
        except BaseException:
            self.stop()
            raise

    def supervise_once(self) -> list[str]:
        """Restart every child that exited unasked or stopped answering its liveness probe;
        returns one report per restart, each also logged (structured) once.

        A crash is reported with its exit code and log tail; an unresponsive (frozen) child
        in one line, then killed with SIGKILL, which a stopped process cannot miss. Raises
        ChildFailedError when a restarted child does not become healthy again.
        """
        reports = []
        for child in self.supervisor.crashed():
            code = child.popen.returncode if child.popen is not None else "?"
            log.warning(
                "child exited; restarting it",
                extra={"child": child.name, "pid": child.pid, "exit_code": code, "reported": True},
            )
            reports.append(
                f"{child.name} exited with code {code}; restarting. Last lines of "
                f"{child.log_path}:\n{child.tail(10)}"
            )
            reports += self._restart(child, kill=False)
        for child in self.supervisor.unresponsive(self.liveness):
            reports.append(unresponsive_report(child, self.liveness))
            log.warning(
                "child unresponsive; killing and restarting it",
                extra={**unresponsive_fields(child, self.liveness), "reported": True},
            )
            reports += self._restart(child, kill=True)
        return reports

    def _restart(self, child: Child, *, kill: bool) -> list[str]:
        """Restart ``child`` and wait until it is healthy; an engine gets its run-time
        adapters back (a new process holds none). What failed, if anything."""
        self.supervisor.restart(child, kill=kill)
        engine = any(replica.child is child for replica in self.replicas)
        timeout = self.engine_timeout_s if engine else self.health_timeout_s
        self.supervisor.wait_healthy(child, timeout)
        return [
            f"{replica.name}: {error}"
            for replica in self.replicas
            if replica.child is child
            for error in self.load_adapters(replica)
        ]

    def load_adapters(self, replica: Replica) -> list[str]:
        """Load the declared adapters of a ``lora.dynamic`` tier into ``replica``'s engine (and
        unload any other); what failed, if anything."""
        adapters = self.run_time_adapters.get(replica.tier)
        if adapters is None:
            return []
        return self._adapters.sync(f"http://{replica.address}", adapters).errors

    def write_router_config(self) -> None:
        """Write the router's config and endpoints file, each atomically: the router polls
        them and must never read one half-written (a temporary file in the same directory,
        then a rename)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for index in range(len(self.router_ports)):
            config = self.router_config(index).to_wire()
            _write_atomic(self.router_config_path(index), yaml.safe_dump(config, sort_keys=False))
        _write_atomic(self.endpoints_path, yaml.safe_dump(self.endpoints(), sort_keys=False))

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
        port, events, replay, *extra = (
            self._free_port(taken) for _ in range(3 + len(self.backend.extra_ports))
        )
        index = max((r.index for r in self.role_replicas(tier, role)), default=-1) + 1
        replica = self._replica(resolved, index, port, (events, replay), extra)
        replica.child = self._start_engine(replica)
        self.replicas.append(replica)
        return replica

    @staticmethod
    def _free_port(taken: set[int]) -> int:
        """A free loopback port not in ``taken`` (which it joins)."""
        port = free_port(HOST)
        while port in taken or port_in_use(port, HOST):
            port = free_port(HOST)
        taken.add(port)
        return port

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
            if not r.serving
            and r.child is not None
            and r.child.alive()
            and r.child.healthy(0.5)
            and not self.load_adapters(r)  # a failed load is tried again next time
        ]
        for replica in joined:
            self._mark_serving(replica)
        if joined:
            self.write_router_config()
        return bool(joined)

    def _mark_serving(self, replica: Replica, now: datetime | None = None) -> None:
        """``replica`` joins the router: its launch to now is one cold start of its role, kept
        as the operator keeps a pod's (the last ten, in the service's status shape), so the
        fleet's autoscaler reads it exactly as under the operator."""
        replica.serving = True
        if replica.launched_at is None:
            return
        ready = now or datetime.now(UTC)
        took = max(0, round((ready - replica.launched_at).total_seconds()))
        sample = ColdStartSample(
            pod=replica.name, started_at=replica.launched_at, ready_at=ready,
            start_seconds=took, pod_seconds=took,
        )  # fmt: skip
        key = (replica.tier, str(replica.role))
        updated = cold_start(self.cold_starts.get(key), [sample])
        if updated is not None:
            self.cold_starts[key] = updated

    def status(self) -> InferenceServiceStatus:
        """The fleet as the operator would report it: per tier and role, replicas, ready ones
        and the observed cold starts."""
        tiers = []
        for tier in self.service.spec.tiers:
            roles = []
            for role in tier.role_names:
                members = self.role_replicas(tier.name, role)
                roles.append(
                    RoleStatus(
                        role=str(role),
                        replicas=len(members),
                        ready=sum(r.serving for r in members),
                        cold_start=self.cold_starts.get((tier.name, str(role))),
                    )
                )
            tiers.append(TierStatus(name=tier.name, roles=roles))
        return InferenceServiceStatus(tiers=tiers)

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
        self._adapters.close()

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
]


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
