"""The router's endpoint types, pure: which engine replica is where (``Endpoint``), the
interface every source of them implements (``EndpointSource``), and the config's own
``addresses`` as a source (``StaticSource``). The sources that read files or watch the
Kubernetes API live in ``discovery``; the router and the policies need only these types.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from fleetpilot.api.router_config import EndpointGroup, RouterConfig


@dataclass(frozen=True, slots=True)
class KVPorts:
    """Where one replica publishes its KV events: rank r of a data-parallel replica publishes
    on ``events + r`` and replays on ``replay + r`` (vLLM offsets both by the rank)."""

    events: int
    replay: int | None = None
    ranks: int = 1


def kv_stream_id(replica_id: str, rank: int) -> str:
    """The KV index's name for one rank's event stream of a replica (rank 0: the replica)."""
    return replica_id if rank == 0 else f"{replica_id}#dp{rank}"


def replica_of_stream(stream: str) -> str:
    """The replica a ``kv_stream_id`` belongs to."""
    return stream.partition("#dp")[0]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine replica (one pod, or one process of the local runtime)."""

    tier: str
    role: str
    host: str
    port: int
    name: str = ""
    kv: KVPorts | None = None

    @property
    def url_host(self) -> str:
        """The host as it stands before ``:port`` in an address (IPv6 bracketed)."""
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def id(self) -> str:
        return f"{self.url_host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.id}"

    def kv_streams(self) -> dict[str, tuple[str, str | None]]:
        """Per event stream (``kv_stream_id``), its publisher and replay endpoints; empty for
        a replica that publishes no events."""
        if self.kv is None:
            return {}
        host = self.url_host
        replay = self.kv.replay
        return {
            kv_stream_id(self.id, r): (
                f"tcp://{host}:{self.kv.events + r}",
                f"tcp://{host}:{replay + r}" if replay is not None else None,
            )
            for r in range(self.kv.ranks)
        }


def group_kv_ports(group: EndpointGroup) -> KVPorts | None:
    """The KV-event ports the config gives a group's engines, if they publish."""
    if group.kv_events_port is None:
        return None
    return KVPorts(group.kv_events_port, group.kv_replay_port, group.data_parallel)


def parse_address(address: str) -> tuple[str, int]:
    """``"10.0.0.7:8000"`` or ``"[fd00::7]:8000"`` -> host and port."""
    text = address.strip()
    if text.startswith("["):
        end = text.find("]")
        if end == -1 or text[end + 1 : end + 2] != ":":
            raise ValueError(f"invalid address {address!r}: expected [ipv6]:port")
        host, port_text = text[1:end], text[end + 2 :]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or ":" in host:
            raise ValueError(f"invalid address {address!r}: expected host:port")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"invalid address {address!r}: port must be 1..65535")
    return host, int(port_text)


class EndpointSource(Protocol):
    """Where the router's replicas come from."""

    @property
    def version(self) -> int:
        """Grows whenever ``endpoints()`` changes."""
        ...

    def endpoints(self) -> tuple[Endpoint, ...]: ...

    def configure(self, config: RouterConfig) -> None:
        """The router config changed: follow its groups."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def config_groups(config: RouterConfig) -> Iterator[tuple[str, EndpointGroup]]:
    for tier in config.tiers:
        for group in tier.endpoints:
            yield tier.name, group


class PublishedEndpoints:
    """The endpoints a source last found, and a version that moves only when they change
    (the router rebuilds its replica set on a new version, never on an unchanged list)."""

    def __init__(self) -> None:
        self._endpoints: tuple[Endpoint, ...] = ()
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._endpoints

    def _set_endpoints(self, new: tuple[Endpoint, ...]) -> bool:
        """Publish ``new``; True if it differs from what was published."""
        if new == self._endpoints:
            return False
        self._endpoints = new
        self._version += 1
        return True


class StaticSource(PublishedEndpoints):
    """The ``addresses`` of the config's endpoint groups."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        super().__init__()
        if config is not None:
            self.configure(config)

    def configure(self, config: RouterConfig) -> None:
        found = []
        for tier, group in config_groups(config):
            for address in group.addresses:
                host, port = parse_address(address)
                found.append(Endpoint(tier, group.role, host, port, address, group_kv_ports(group)))
        self._set_endpoints(tuple(found))

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
