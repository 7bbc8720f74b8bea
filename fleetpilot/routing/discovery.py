"""Endpoint discovery: which engine replicas exist, in which tier and role, and where.

One interface (``endpoints.EndpointSource``), three sources:

- ``StaticSource`` (in ``endpoints``, pure): the ``addresses`` listed in the router config
  (the local runtime);
- ``FileSource``: a YAML/JSON file of endpoints, re-read when it changes (a local fleet whose
  engines come and go);
- ``KubernetesSource``: each group's Service's EndpointSlices, watched by the
  ``kubernetes.io/service-name`` label in a thread; only Ready, non-terminating endpoints.

A source publishes a tuple of ``Endpoint`` and a ``version`` that grows on every change; the
router re-reads the tuple when the version moves. The router only ever connects to addresses a
source produced: request data never becomes a host or port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fleetpilot import files
from fleetpilot.api.router_config import RouterConfig
from fleetpilot.api.spec import RoleName
from fleetpilot.routing.endpoints import (
    Endpoint,
    EndpointSource,
    KVPorts,
    PublishedEndpoints,
    StaticSource,
    config_groups,
    group_kv_ports,
    parse_address,
)
from fleetpilot.routing.tasks import cancel

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def parse_endpoints_file(data: Any, source: str | None = None) -> tuple[Endpoint, ...]:
    """``{"endpoints": [{"tier", "role", "address", "name"?, "kvEventsPort"?,
    "kvReplayPort"?}, ...]}`` -> endpoints (the KV ports on the address's host). ``source``
    (the file's name) prefixes the error."""
    try:
        return _endpoints_of(data)
    except ValueError as exc:
        if source is None:
            raise
        raise ValueError(f"{source}: {exc}") from None


def _endpoints_of(data: Any) -> tuple[Endpoint, ...]:
    if not isinstance(data, dict) or not isinstance(data.get("endpoints"), list):
        raise ValueError("an endpoints file is a mapping with an 'endpoints' list")
    out = []
    for i, item in enumerate(data["endpoints"]):
        if not isinstance(item, dict):
            raise ValueError(f"endpoints[{i}] must be a mapping")
        tier, role, address = (
            item.get("tier"),
            item.get("role", RoleName.UNIFIED.value),
            item.get("address"),
        )
        if not isinstance(tier, str) or not isinstance(address, str):
            raise ValueError(f"endpoints[{i}] needs string 'tier' and 'address'")
        if role not in set(RoleName):
            raise ValueError(f"endpoints[{i}].role must be one of {', '.join(RoleName)}")
        host, port = parse_address(address)
        name = item.get("name")
        kv = _file_kv_ports(item, i)
        out.append(Endpoint(tier, role, host, port, name if isinstance(name, str) else address, kv))
    return tuple(out)


def _file_kv_ports(item: dict[str, Any], index: int) -> KVPorts | None:
    ports: list[int | None] = []
    for key in ("kvEventsPort", "kvReplayPort"):
        value = item.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535
        ):
            raise ValueError(f"endpoints[{index}].{key} must be a port number 1..65535")
        ports.append(value)
    events, replay = ports
    if events is None:
        if replay is not None:
            raise ValueError(f"endpoints[{index}].kvReplayPort needs kvEventsPort")
        return None
    return KVPorts(events, replay)


class FileSource(PublishedEndpoints):
    """Endpoints from a file the local runtime rewrites as engines start and stop.

    Polled (a stat and a read per interval) rather than watched with inotify: it works the same
    on every platform and for files replaced by rename, and one small read a second is free.
    The file gets the guards of every file an entry point reads (:mod:`fleetpilot.files`): at
    start a bad file is an error; later, a change that cannot be used keeps the previous
    endpoints and is told once - one warning naming the file and the reason, one
    ``on_result`` count (``invalid`` or ``unreadable``).
    """

    def __init__(
        self,
        path: Path,
        interval_s: float = 1.0,
        *,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        self.path = path
        self.interval_s = interval_s
        self.on_result = on_result
        self.file = files.WatchedFile(path, what="endpoints file")
        self._task: asyncio.Task[None] | None = None
        text = self.file.read_change()  # FileError (a ValueError) at start: the caller says so
        assert text is not None  # the first read of a readable file is a change
        self._set_endpoints(parse_endpoints_file(files.parse_yaml(text, str(path)), str(path)))

    def configure(self, config: RouterConfig) -> None:
        return None

    def reload(self) -> bool:
        """Re-read the file; True if the endpoints changed."""
        try:
            text = self.file.read_change()
            if text is None:
                return False
            new = parse_endpoints_file(files.parse_yaml(text, str(self.path)))
        except ValueError as exc:  # FileError included
            if isinstance(exc, files.FileError):
                result, reason = exc.result, exc.reason
            else:  # the YAML is fine, its endpoints are not
                result, reason = "invalid", str(exc)
            log.warning(
                "endpoints file refused; keeping the last endpoints",
                extra={"path": str(self.path), "result": result, "reason": reason},
            )
            self._result(result)
            return False
        self._result("applied")
        if not self._set_endpoints(new):
            return False
        log.info("endpoints changed", extra={"source": "file", "count": len(new)})
        return True

    def _result(self, result: str) -> None:
        if self.on_result is not None:
            self.on_result(result)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.reload()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._poll(), name="endpoints-file")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None


class MergedSource:
    """Several sources as one (static addresses plus Kubernetes discovery)."""

    def __init__(self, sources: Sequence[EndpointSource]) -> None:
        self.sources = list(sources)

    @property
    def version(self) -> int:
        # Each part only grows, so the sum grows whenever any part changes.
        return sum(s.version for s in self.sources)

    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(e for s in self.sources for e in s.endpoints())

    def configure(self, config: RouterConfig) -> None:
        for s in self.sources:
            s.configure(config)

    async def start(self) -> None:
        for s in self.sources:
            await s.start()

    async def stop(self) -> None:
        for s in self.sources:
            await s.stop()


# -- Kubernetes ------------------------------------------------------------------------------


def endpoints_from_slices(
    slices: Iterable[dict[str, Any]],
    tier: str,
    role: str,
    port: int,
    kv: KVPorts | None = None,
) -> list[Endpoint]:
    """The Ready endpoints of a Service's EndpointSlices (camelCase dicts, as the API returns
    them). Purely computational.

    Only ``conditions.ready == true`` counts: the API allows a missing condition to mean
    ready, but the EndpointSlice controller always sets it, and sending to a pod that is not
    known to be ready is the one thing the router must never do. Terminating endpoints are
    skipped too. The port is the group's engine port: the planner gives every engine the
    same one. Duplicates (a pod briefly in two slices) are listed once.
    """
    seen: set[str] = set()
    out = []
    for item in slices:
        if item.get("addressType") not in ("IPv4", "IPv6"):
            continue
        for ep in item.get("endpoints") or []:
            conditions = ep.get("conditions") or {}
            if conditions.get("ready") is not True or conditions.get("terminating") is True:
                continue
            addresses = ep.get("addresses") or []
            if not addresses or not isinstance(addresses[0], str):
                continue
            endpoint = Endpoint(tier, role, addresses[0], port, _pod_name(ep) or addresses[0], kv)
            if endpoint.id not in seen:
                seen.add(endpoint.id)
                out.append(endpoint)
    return out


def _pod_name(ep: dict[str, Any]) -> str | None:
    ref = ep.get("targetRef") or {}
    name = ref.get("name")
    return name if ref.get("kind") == "Pod" and isinstance(name, str) else None


class SliceClient(Protocol):
    """List and watch the EndpointSlices of one Service (blocking; runs in a thread)."""

    def list(self, namespace: str, service: str) -> tuple[list[dict[str, Any]], str]:
        """The slices and the list's resourceVersion."""
        ...

    def watch(
        self, namespace: str, service: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(type, object)`` events until the server ends the watch."""
        ...


class KubeSliceClient:
    """``SliceClient`` over the official kubernetes client."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client as k8s

        self._api = k8s.DiscoveryV1Api(api_client)

    def list(self, namespace: str, service: str) -> tuple[list[dict[str, Any]], str]:
        # _preload_content=False: the raw JSON, camelCase, as endpoints_from_slices reads it.
        response: Any = self._api.list_namespaced_endpoint_slice(
            namespace,
            label_selector=f"{SERVICE_NAME_LABEL}={service}",
            _preload_content=False,
            _request_timeout=30,
        )
        data = json.loads(response.data)
        return list(data.get("items") or []), str(data["metadata"].get("resourceVersion", ""))

    def watch(
        self, namespace: str, service: str, resource_version: str, timeout_s: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        from kubernetes import watch

        w = watch.Watch()  # type: ignore[no-untyped-call]
        stream = w.stream(  # type: ignore[no-untyped-call]
            self._api.list_namespaced_endpoint_slice,
            namespace,
            label_selector=f"{SERVICE_NAME_LABEL}={service}",
            resource_version=resource_version,
            timeout_seconds=timeout_s,
            _request_timeout=timeout_s + 10,
        )
        try:
            for event in stream:
                yield str(event["type"]), dict(event.get("raw_object") or {})
        finally:
            w.stop()  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class _GroupKey:
    tier: str
    role: str
    service: str
    port: int
    kv: KVPorts | None = None


class KubernetesSource(PublishedEndpoints):
    """Watches each endpoint group's EndpointSlices in a daemon thread per group.

    Threads, not the event loop: the kubernetes client is blocking. Each thread lists, then
    watches from the list's resourceVersion; when a watch ends or fails it lists again (a
    handful of slices per Service make a relist cheap, and it recovers from a 410 Gone the same
    way). Results reach the loop through ``call_soon_threadsafe``, so the endpoint tuple is only
    ever touched on the loop.
    """

    def __init__(
        self,
        namespace: str,
        client: SliceClient,
        *,
        watch_timeout_s: int = 60,
        retry_delay_s: float = 2.0,
    ) -> None:
        super().__init__()
        self.namespace = namespace
        self.client = client
        self.watch_timeout_s = watch_timeout_s
        self.retry_delay_s = retry_delay_s
        self._by_group: dict[_GroupKey, tuple[Endpoint, ...]] = {}
        self._stops: dict[_GroupKey, threading.Event] = {}
        self._wanted: set[_GroupKey] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def configure(self, config: RouterConfig) -> None:
        self.namespace = config.namespace
        self._wanted = {
            _GroupKey(tier, g.role, g.service, g.port, group_kv_ports(g))
            for tier, g in config_groups(config)
            if not g.addresses
        }
        if self._loop is not None:
            self._sync_threads()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sync_threads()

    async def stop(self) -> None:
        for stop in self._stops.values():
            stop.set()
        self._stops.clear()
        self._loop = None

    def _sync_threads(self) -> None:
        for key in [k for k in self._stops if k not in self._wanted]:
            self._stops.pop(key).set()
            self._by_group.pop(key, None)
        for key in self._wanted - set(self._stops):
            stop = threading.Event()
            self._stops[key] = stop
            thread = threading.Thread(
                target=self._run,
                args=(key, stop),
                name=f"endpointslices-{key.service}",
                daemon=True,
            )
            thread.start()
        self._rebuild()

    def _rebuild(self) -> None:
        self._set_endpoints(
            tuple(e for key in sorted(self._by_group, key=repr) for e in self._by_group[key])
        )

    def _publish(self, key: _GroupKey, stop: threading.Event, endpoints: list[Endpoint]) -> None:
        if stop.is_set():
            return  # a group removed by a config change: its last result is void
        before = self._by_group.get(key)
        self._by_group[key] = tuple(endpoints)
        if before != self._by_group[key]:
            log.info(
                "endpoints changed",
                extra={"source": "kubernetes", "service": key.service, "ready": len(endpoints)},
            )
        self._rebuild()

    def _send(self, key: _GroupKey, stop: threading.Event, slices: dict[str, Any]) -> None:
        endpoints = endpoints_from_slices(slices.values(), key.tier, key.role, key.port, key.kv)
        loop = self._loop
        if loop is not None and not stop.is_set():
            with contextlib.suppress(RuntimeError):  # loop closed while we were blocked
                loop.call_soon_threadsafe(self._publish, key, stop, endpoints)

    def _run(self, key: _GroupKey, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                items, version = self.client.list(self.namespace, key.service)
                slices = {_slice_name(s): s for s in items}
                self._send(key, stop, slices)
                for kind, obj in self.client.watch(
                    self.namespace, key.service, version, self.watch_timeout_s
                ):
                    if stop.is_set():
                        return
                    if kind == "ERROR":
                        break  # e.g. 410 Gone: relist
                    if kind in ("ADDED", "MODIFIED"):
                        slices[_slice_name(obj)] = obj
                    elif kind == "DELETED":
                        slices.pop(_slice_name(obj), None)
                    else:
                        continue  # BOOKMARK
                    self._send(key, stop, slices)
            except Exception as exc:  # keep watching through API server restarts
                log.warning(
                    "endpointslice watch failed",
                    extra={"service": key.service, "err": f"{type(exc).__name__}: {exc}"},
                )
                stop.wait(self.retry_delay_s)


def _slice_name(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def build_source(
    config: RouterConfig,
    *,
    endpoints_file: Path | None = None,
    kube_client: Callable[[], SliceClient] | None = None,
) -> EndpointSource:
    """The source for a config: the endpoints file if given, else the config's static
    addresses plus Kubernetes discovery for every group without addresses."""
    if endpoints_file is not None:
        return MergedSource([StaticSource(config), FileSource(endpoints_file)])
    static = StaticSource(config)
    if all(g.addresses for _, g in config_groups(config)) or kube_client is None:
        return static
    kube = KubernetesSource(config.namespace, kube_client())
    kube.configure(config)
    return MergedSource([static, kube])
