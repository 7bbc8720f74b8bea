"""Endpoint discovery: addresses, static and file sources, EndpointSlice parsing, and the
Kubernetes source's list/watch threads (against a scripted slice client)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetpilot.routing.discovery import (
    FileSource,
    KubernetesSource,
    MergedSource,
    build_source,
    endpoints_from_slices,
    parse_endpoints_file,
)
from fleetpilot.routing.endpoints import Endpoint, KVPorts, StaticSource, parse_address
from tests.routing.support import make_config, tier


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.7:8000", ("10.0.0.7", 8000)),
        (" localhost:1 ", ("localhost", 1)),
        ("[fd00::7]:8000", ("fd00::7", 8000)),
    ],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    """host:port and [ipv6]:port."""
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    "text", ["10.0.0.7", ":80", "a:b", "a:0", "a:70000", "fd00::7:80", "[fd00::7]80", ""]
)
def test_parse_address_refuses_malformed(text: str) -> None:
    """Anything but host:port is refused."""
    with pytest.raises(ValueError, match="invalid address"):
        parse_address(text)


def test_endpoint_ids_and_urls() -> None:
    """IPv6 hosts are bracketed in ids and URLs."""
    assert Endpoint("t", "unified", "fd00::1", 80).base_url == "http://[fd00::1]:80"
    assert Endpoint("t", "unified", "10.0.0.1", 80).id == "10.0.0.1:80"


def test_static_source_versions_only_on_change() -> None:
    """The version moves when the addresses change, not on every configure."""
    config = make_config([tier("a", 1.0)])
    data = config.to_wire()
    data["tiers"][0]["endpoints"][0]["addresses"] = ["10.0.0.1:8000"]
    with_one = type(config).model_validate(data)
    source = StaticSource(with_one)
    version = source.version
    source.configure(with_one)
    assert source.version == version
    assert [e.id for e in source.endpoints()] == ["10.0.0.1:8000"]
    source.configure(config)
    assert source.version == version + 1
    assert source.endpoints() == ()


@pytest.mark.parametrize(
    "data",
    [
        [],
        {"endpoints": "x"},
        {"endpoints": ["x"]},
        {"endpoints": [{"tier": "a"}]},
        {"endpoints": [{"tier": "a", "address": "x:1", "role": "boss"}]},
        {"endpoints": [{"tier": "a", "address": "nope"}]},
    ],
)
def test_endpoints_file_errors(data: Any) -> None:
    """A malformed endpoints file is refused with a reason."""
    with pytest.raises(ValueError, match=r"endpoints|address"):
        parse_endpoints_file(data)


def test_file_source_keeps_the_last_good_endpoints(tmp_path: Path) -> None:
    """An invalid rewrite of the endpoints file leaves the endpoints as they were."""
    path = tmp_path / "endpoints.yaml"
    path.write_text(yaml.safe_dump({"endpoints": [{"tier": "a", "address": "10.0.0.1:80"}]}))
    source = FileSource(path)
    assert [e.id for e in source.endpoints()] == ["10.0.0.1:80"]
    path.write_text("endpoints: [{tier: a, address: broken}]")
    assert not source.reload()
    assert [e.id for e in source.endpoints()] == ["10.0.0.1:80"]
    path.unlink()
    assert not source.reload()
    assert len(source.endpoints()) == 1


def test_endpoints_file_gives_each_engine_its_kv_event_ports(tmp_path: Path) -> None:
    """Each listed engine's KV-event ports are on its own host; an engine without them
    publishes nothing; a replay port alone or a non-port is refused."""
    found = parse_endpoints_file({"endpoints": [
        {"tier": "a", "address": "127.0.0.1:8001", "kvEventsPort": 9001, "kvReplayPort": 9002},
        {"tier": "a", "address": "127.0.0.1:8002"},
    ]})  # fmt: skip
    assert [e.kv for e in found] == [KVPorts(9001, 9002), None]
    assert found[0].kv_streams() == {
        "127.0.0.1:8001": ("tcp://127.0.0.1:9001", "tcp://127.0.0.1:9002")
    }
    assert found[1].kv_streams() == {}
    for bad in ({"kvReplayPort": 9002}, {"kvEventsPort": 0}, {"kvEventsPort": "9001"}):
        with pytest.raises(ValueError, match=r"endpoints\[0\]\.kv"):
            parse_endpoints_file({"endpoints": [{"tier": "a", "address": "h:1", **bad}]})


def test_a_data_parallel_replica_has_one_event_stream_per_rank() -> None:
    """vLLM offsets both KV-event ports by the data-parallel rank: a replica of two ranks is
    two streams, the first named as the replica; IPv6 hosts are bracketed."""
    endpoint = Endpoint("t", "unified", "fd00::1", 8000, kv=KVPorts(5557, 5559, ranks=2))
    assert endpoint.kv_streams() == {
        "[fd00::1]:8000": ("tcp://[fd00::1]:5557", "tcp://[fd00::1]:5559"),
        "[fd00::1]:8000#dp1": ("tcp://[fd00::1]:5558", "tcp://[fd00::1]:5560"),
    }


def test_discovered_pods_take_their_groups_kv_event_ports() -> None:
    """Pods found in EndpointSlices carry the ports the config gives their group."""
    kv = KVPorts(5557, 5558)
    (found,) = endpoints_from_slices([slice_("s", ep("10.0.0.1"))], "a", "unified", 8000, kv)
    assert found.kv == kv
    config = make_config([tier("a", 1.0)])
    data = config.to_wire()
    group = data["tiers"][0]["endpoints"][0]
    group.update(addresses=["10.0.0.9:8000"], kvEventsPort=5557, kvReplayPort=5558)
    (static,) = StaticSource(type(config).model_validate(data)).endpoints()
    assert static.kv == kv


def slice_(name: str, *endpoints: dict[str, Any], address_type: str = "IPv4") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "svc"}},
        "addressType": address_type,
        "endpoints": list(endpoints),
        "ports": [{"name": "http", "port": 8000}],
    }


def ep(ip: str, ready: Any = True, terminating: Any = None, pod: str | None = None) -> Any:
    conditions = {"ready": ready}
    if terminating is not None:
        conditions["terminating"] = terminating
    out: dict[str, Any] = {"addresses": [ip], "conditions": conditions}
    if pod:
        out["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "ns"}
    return out


def test_only_ready_non_terminating_endpoints_count() -> None:
    """Ready true only (not false, not missing), never terminating; FQDN slices skipped;
    an address in two slices is listed once; pod names come from targetRef."""
    slices = [
        slice_(
            "s1",
            ep("10.0.0.1", pod="pod-1"),
            ep("10.0.0.2", ready=False),
            ep("10.0.0.3", ready=None),
            ep("10.0.0.4", terminating=True),
        ),
        slice_("s2", ep("10.0.0.1"), ep("fd00::5")),
        slice_("s3", ep("db.example.com"), address_type="FQDN"),
        {"metadata": {"name": "broken"}, "addressType": "IPv4", "endpoints": [{"addresses": []}]},
    ]
    found = endpoints_from_slices(slices, "small", "unified", 8000)
    assert [(e.id, e.name) for e in found] == [
        ("10.0.0.1:8000", "pod-1"),
        ("[fd00::5]:8000", "fd00::5"),
    ]
    assert {(e.tier, e.role) for e in found} == {("small", "unified")}


class ScriptedSlices:
    """A SliceClient whose list answers and watch events the test feeds."""

    def __init__(self) -> None:
        self.items: dict[str, list[dict[str, Any]]] = {}
        self.events: dict[str, queue.Queue[tuple[str, dict[str, Any]] | None]] = {}
        self.lists: dict[str, int] = {}
        self.lock = threading.Lock()

    def list(self, namespace: str, service: str) -> tuple[list[dict[str, Any]], str]:
        with self.lock:
            self.lists[service] = self.lists.get(service, 0) + 1
            return list(self.items.get(service, [])), "1"

    def watch(
        self, namespace: str, service: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        q = self.events.setdefault(service, queue.Queue())
        while True:
            try:
                event = q.get(timeout=0.05)
            except queue.Empty:
                return  # a watch that times out: the source relists
            if event is None:
                return
            yield event

    def send(self, service: str, kind: str, obj: dict[str, Any]) -> None:
        self.events.setdefault(service, queue.Queue()).put((kind, obj))


async def wait_until(predicate: Any, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")


@pytest.mark.asyncio
async def test_kubernetes_source_lists_watches_and_follows_config() -> None:
    """Each group's slices are listed then watched; events update the endpoints; a group
    dropped from the config loses its endpoints; groups with static addresses are not
    watched."""
    config = make_config([tier("small", 0.4), tier("large", 1.0)])
    client = ScriptedSlices()
    client.items["chat-small"] = [slice_("s1", ep("10.0.0.1"))]
    source = KubernetesSource("test", client, retry_delay_s=0.01)
    source.configure(config)
    await source.start()
    try:
        await wait_until(lambda: [e.id for e in source.endpoints()] == ["10.0.0.1:8000"])
        v = source.version
        client.send("chat-large", "ADDED", slice_("l1", ep("10.0.1.1"), ep("10.0.1.2", False)))
        await wait_until(lambda: len(source.endpoints()) == 2)
        assert source.version > v
        large = [e for e in source.endpoints() if e.tier == "large"]
        assert [e.id for e in large] == ["10.0.1.1:8000"]
        client.send("chat-large", "MODIFIED", slice_("l1", ep("10.0.1.1", False)))
        await wait_until(lambda: len(source.endpoints()) == 1)
        client.send("chat-small", "DELETED", slice_("s1"))
        client.items["chat-small"] = []
        await wait_until(lambda: source.endpoints() == ())
        # Drop the large tier: its watch stops and its endpoints go.
        client.send("chat-large", "ADDED", slice_("l2", ep("10.0.1.9")))
        await wait_until(lambda: len(source.endpoints()) == 1)
        source.configure(make_config([tier("small", 1.0)]))
        assert source.endpoints() == ()
    finally:
        await source.stop()


@pytest.mark.asyncio
async def test_kubernetes_source_survives_api_errors() -> None:
    """A failing list is retried; the source recovers when the API server answers again."""

    class Flaky(ScriptedSlices):
        failures = 3

        def list(self, namespace: str, service: str) -> tuple[list[dict[str, Any]], str]:
            if self.failures:
                self.failures -= 1
                raise ConnectionError("apiserver down")
            return super().list(namespace, service)

    client = Flaky()
    client.items["chat-small"] = [slice_("s1", ep("10.0.0.1"))]
    source = KubernetesSource("test", client, retry_delay_s=0.01)
    source.configure(make_config([tier("small", 1.0)]))
    await source.start()
    try:
        await wait_until(lambda: len(source.endpoints()) == 1)
    finally:
        await source.stop()


def test_build_source_picks_static_file_or_kubernetes(tmp_path: Path) -> None:
    """Static when every group lists addresses or no cluster client is given; the endpoints
    file when one is given; Kubernetes for groups without addresses otherwise."""
    config = make_config([tier("small", 1.0)])
    assert isinstance(build_source(config), StaticSource)
    path = tmp_path / "e.yaml"
    path.write_text("endpoints: []")
    assert isinstance(build_source(config, endpoints_file=path), MergedSource)
    merged = build_source(config, kube_client=ScriptedSlices)
    assert isinstance(merged, MergedSource)
    assert any(isinstance(s, KubernetesSource) for s in merged.sources)
