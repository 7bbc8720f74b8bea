"""Which peers a reference engine trusts with the P/D KV hand-off. Purely computational.

The hand-off is unauthenticated (as vLLM's NIXL side channel is): a decode server connects to
whatever ``remote_host``/``remote_port`` a request's ``kv_transfer_params`` name, and a prefill
server's ``/internal/kv/<id>`` hands a prompt's KV blocks and token ids to whoever asks. An
:class:`AllowedPeers` list bounds both directions:

* pulls (decode side) go only to a listed host, and to its port when the entry names one;
* ``/internal/kv`` (prefill side) answers only callers whose address is listed. A caller is
  known by its address alone (its port is ephemeral, and nothing is resolved), so hostname
  entries allow pulls but never callers: list the peers' addresses or a CIDR for those.

Entries: an IP address, a CIDR network (``10.0.0.0/8``), a hostname, each optionally with a
port (``127.0.0.1:8001``, ``[::1]:8001``, ``engine-0.local:8000``), or ``*`` for any host
(only behind a network policy that already restricts who reaches the engine).

The default, :data:`LOOPBACK`, is the safest list under which existing setups keep working:
the local fleet and every test run their engines on loopback, and an engine reachable from
other machines then neither pulls from nor serves KV to them until told to.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

ANY = "*"
# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)


@dataclass(frozen=True)
class PeerRule:
    """One entry: a network (a single address is a /32 or /128) or a host name, and a port."""

    network: IPNetwork | None = None
    hostname: str | None = None
    port: int | None = None

    def matches_host(self, host: str | IPAddress) -> bool:
        if isinstance(host, str):
            return self.hostname is not None and self.hostname == host
        return self.network is not None and host in self.network


@dataclass(frozen=True)
class AllowedPeers:
    """The hosts (and ports) a reference engine exchanges KV with; see the module docstring."""

    rules: tuple[PeerRule, ...] = ()
    any_host: bool = False
    entries: tuple[str, ...] = ()  # as given, for messages

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowedPeers:
        """The list from its entries; ValueError naming the first bad one."""
        given = tuple(e.strip() for e in entries if e.strip())
        if not given:
            raise ValueError("the list is empty (use '*' to allow any host)")
        rules: list[PeerRule] = []
        any_host = False
        for entry in given:
            if entry == ANY:
                any_host = True
            else:
                rules.append(_parse_entry(entry))
        return cls(tuple(rules), any_host, given)

    def allows_pull(self, host: str, port: int) -> bool:
        """Whether a decode server may connect to ``host:port`` for KV."""
        if self.any_host:
            return True
        target = _host_key(host)
        if target is None:
            return False
        return any(r.matches_host(target) and r.port in (None, port) for r in self.rules)

    def allows_caller(self, address: str) -> bool:
        """Whether a peer connecting from ``address`` (an IP) may fetch or release KV."""
        if self.any_host:
            return True
        ip = _ip(address)
        return ip is not None and any(r.matches_host(ip) for r in self.rules)

    def __str__(self) -> str:
        return ",".join(self.entries)


def _ip(text: str) -> IPAddress | None:
    try:
        ip = ipaddress.ip_address(text.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None
    # A dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d; the list names them as IPv4.
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _host_key(host: str) -> str | IPAddress | None:
    """An address as an IP, a name in canonical (lower-case, no trailing dot) form, or None."""
    ip = _ip(host)
    if ip is not None:
        return ip
    name = host.lower().removesuffix(".")
    return name if _HOSTNAME.match(name) else None


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [v6] or [v6]:port
        host, sep, rest = entry[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{entry!r}: unbalanced brackets")
        return host, _port(entry, rest[1:]) if rest else None
    if entry.count(":") == 1:  # host:port; more colons is a bare IPv6 address
        host, _, port = entry.partition(":")
        return host, _port(entry, port)
    return entry, None


def _port(entry: str, text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{entry!r}: port must be 1..65535")
    return int(text)


def _parse_entry(entry: str) -> PeerRule:
    host, port = _split_port(entry)
    if "/" in host:
        try:
            return PeerRule(network=ipaddress.ip_network(host, strict=False), port=port)
        except ValueError as e:
            raise ValueError(f"{entry!r}: {e}") from None
    key = _host_key(host)
    if key is None:
        raise ValueError(f"{entry!r}: not an IP address, CIDR network or host name")
    if isinstance(key, str):
        return PeerRule(hostname=key, port=port)
    return PeerRule(network=ipaddress.ip_network(key), port=port)


# Every 127.x.y.z is loopback on Linux; ::1 for IPv6 listeners. No names: "localhost" could
# resolve anywhere /etc/hosts says.
LOOPBACK = AllowedPeers.parse(["127.0.0.0/8", "::1"])
