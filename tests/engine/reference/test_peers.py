"""The P/D peer allow-list of the reference engine: parsing and matching (pure)."""

from __future__ import annotations

import pytest

from fleetpilot.engine.reference.peers import LOOPBACK, AllowedPeers


@pytest.mark.parametrize(
    ("entries", "host", "port", "allowed"),
    [
        (["127.0.0.1"], "127.0.0.1", 8000, True),
        (["127.0.0.1"], "127.0.0.2", 8000, False),
        # A name is not resolved: "localhost" is not the address it may resolve to.
        (["127.0.0.1"], "localhost", 8000, False),
        (["127.0.0.1:8001"], "127.0.0.1", 8001, True),
        (["127.0.0.1:8001"], "127.0.0.1", 8002, False),
        (["10.0.0.0/8"], "10.42.3.7", 8000, True),
        (["10.0.0.0/8"], "11.0.0.1", 8000, False),
        (["[::1]:8000"], "::1", 8000, True),
        (["[::1]:8000"], "[::1]", 8000, True),
        (["fd00::/8"], "fd12::5", 1, True),
        (["engine-0.Example.org"], "ENGINE-0.example.org.", 8000, True),
        (["engine-0.example.org"], "engine-1.example.org", 8000, False),
        (["*"], "203.0.113.9", 9, True),
        # Not a host at all: never allowed, whatever the list holds.
        (["engine.local"], "engine.local/../x", 8000, False),
        (["engine.local"], "", 8000, False),
    ],
)
def test_pull_targets(entries: list[str], host: str, port: int, allowed: bool) -> None:
    """A decode server pulls only from listed hosts (and only their port, when one is given)."""
    assert AllowedPeers.parse(entries).allows_pull(host, port) is allowed


@pytest.mark.parametrize(
    ("entries", "caller", "allowed"),
    [
        (["127.0.0.1"], "127.0.0.1", True),
        (["127.0.0.1"], "127.0.0.2", False),
        # The caller's port is ephemeral: a host:port entry allows its host.
        (["127.0.0.1:8001"], "127.0.0.1", True),
        (["10.0.0.0/8"], "::ffff:10.1.2.3", True),  # IPv4 peer of a dual-stack listener
        # Callers are known by address only: a name never matches one.
        (["localhost"], "127.0.0.1", False),
        (["127.0.0.1"], "", False),
        (["*"], "198.51.100.1", True),
    ],
)
def test_kv_callers(entries: list[str], caller: str, allowed: bool) -> None:
    """/internal/kv answers only callers whose address is listed."""
    assert AllowedPeers.parse(entries).allows_caller(caller) is allowed


def test_default_is_loopback_only() -> None:
    """A bare engine trusts its own machine: every 127.x.y.z and ::1, nothing else."""
    assert LOOPBACK.allows_pull("127.0.0.1", 8000)
    assert LOOPBACK.allows_pull("127.3.2.1", 8000)
    assert LOOPBACK.allows_caller("::1")
    assert not LOOPBACK.allows_pull("10.0.0.1", 8000)
    assert not LOOPBACK.allows_pull("localhost", 8000)
    assert not LOOPBACK.allows_caller("192.168.1.10")


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([], "empty"),
        (["127.0.0.1:0"], "port must be 1..65535"),
        (["127.0.0.1:http"], "port must be 1..65535"),
        (["[::1"], "unbalanced brackets"),
        (["10.0.0.0/33"], "10.0.0.0/33"),
        (["not a host"], "not an IP address, CIDR network or host name"),
        (["http://127.0.0.1"], "port must be 1..65535"),
    ],
)
def test_bad_entries_are_refused_by_name(entries: list[str], message: str) -> None:
    """A malformed allow-list entry (empty list, bad port, unbalanced brackets, bad CIDR, not a
    host) is refused with what is wrong, never kept as a rule that matches nothing."""
    with pytest.raises(ValueError, match=message) as refused:
        AllowedPeers.parse(entries)
    if entries:
        assert entries[0] in str(refused.value), "the error must name the entry"
