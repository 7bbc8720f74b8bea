"""Kubernetes API doubles for tests: a counting client and an in-memory API server.

:class:`CountingKube` is the real client counting the writes it sends (the idempotency test
on a real cluster reads it). :class:`FakeKube` answers the REST calls fleetpilot makes from
objects kept in memory, the way the API server would for the parts fleetpilot relies on:

- ``metadata.resourceVersion`` moves on every write, and a write that carries a stale one
  (the optimistic status writers do) is refused with 409;
- server-side apply and merge patches track which field manager owns which field
  (``metadata.managedFields``): an apply takes the fields it sets, removes those its manager
  set before and now omits (unless another manager shares them), and an update takes the
  fields whose values it changed. Lists are atomic here (the real server merges some by key);
- ``generation`` moves when anything outside metadata and status changes; writes to the main
  resource leave ``status`` alone and ``/status`` writes touch nothing else; ``/scale`` sets
  ``spec.replicas``;
- list by label selector (``k=v,...``), delete with garbage collection of the owned, Event
  creation with ``generateName``, and API discovery for :meth:`Kube.serves`.

Tests make other writers race with :meth:`FakeKube.interleave` (run something just before a
matching request) and make the server refuse with :meth:`FakeKube.refuse`; ``calls`` records
every request.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s

from fleetpilot.kube.client import (
    APPLY_CONTENT_TYPE,
    MERGE_CONTENT_TYPE,
    RESOURCES,
    Kube,
    KubeError,
    Obj,
)

Path = tuple[str, ...]
# Written by the server, never owned by a field manager.
_SERVER_META = {
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "managedFields",
    "creationTimestamp",
}


class CountingKube(Kube):
    """The real client, counting the write requests (anything but GET) it sends."""

    def __init__(self, api: k8s.ApiClient, timeout_s: float = 30.0) -> None:
        super().__init__(api, timeout_s)
        self.writes = 0

    def request(self, method: str, path: str, **options: Any) -> Obj:
        if method != "GET":
            self.writes += 1
        return super().request(method, path, **options)


@dataclass(frozen=True)
class Call:
    """One request as :class:`FakeKube` received it."""

    method: str
    path: str
    query: list[tuple[str, str]]
    body: Obj | None
    content_type: str

    @property
    def subresource(self) -> str | None:
        return _parse(self.path).subresource

    @property
    def kind(self) -> str | None:
        return _parse(self.path).kind


@dataclass(frozen=True)
class _Target:
    kind: str | None  # None: a discovery path (/apis/<group>/<version>)
    api_version: str
    namespace: str | None
    name: str | None
    subresource: str | None


_KIND_OF = {(r.api_version, r.plural): kind for kind, r in RESOURCES.items()}


def _parse(path: str) -> _Target:
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        api_version, rest = parts[1], parts[2:]
    else:
        api_version, rest = f"{parts[1]}/{parts[2]}", parts[3:]
    if not rest:
        return _Target(None, api_version, None, None, None)
    namespace = None
    if rest[0] == "namespaces" and len(rest) > 2:
        namespace, rest = rest[1], rest[2:]
    plural, name, sub = rest[0], rest[1] if len(rest) > 1 else None, None
    if len(rest) > 2:
        sub = rest[2]
    kind = _KIND_OF.get((api_version, plural))
    if kind is None:
        raise AssertionError(f"FakeKube does not know {path}")
    return _Target(kind, api_version, namespace, name, sub)


@dataclass
class _Hook:
    method: str
    kind: str | None
    subresource: str | None
    times: int | None  # None: every time
    action: Callable[[], None] | None = None
    status: int = 0

    def matches(self, method: str, target: _Target) -> bool:
        return (
            self.method == method
            and (self.kind is None or self.kind == target.kind)
            and self.subresource == target.subresource
        )

    def use(self) -> bool:
        """Count one use; False once spent."""
        if self.times is None:
            return True
        self.times -= 1
        return self.times >= 0


Owner = tuple[str, str, str]  # (manager, Apply | Update, subresource or "")


@dataclass
class _Stored:
    obj: Obj
    owners: dict[Owner, set[Path]] = field(default_factory=dict)  # managedFields, as sets


class FakeKube(Kube):
    """An in-memory API server behind the :class:`Kube` interface (see the module doc)."""

    def __init__(self, *, unserved: tuple[str, ...] = ("PodMonitor",)) -> None:
        super().__init__(api=None)  # type: ignore[arg-type]  # never used: request is ours
        self.unserved = set(unserved)
        self.calls: list[Call] = []
        self._store: dict[tuple[str, str | None, str], _Stored] = {}
        self._versions = itertools.count(100)
        self._uids = itertools.count(1)
        self._names = itertools.count(1)
        self._hooks: list[_Hook] = []
        # Container logs by (namespace, pod): a kubelet's, which an API server only relays.
        self.logs: dict[tuple[str, str], str] = {}

    # -- test controls ------------------------------------------------------------------------
    def put(self, obj: Obj) -> Obj:
        """Store ``obj`` as it stands (status included), as if the cluster already held it;
        the server's fields (uid, resourceVersion, generation) are filled in when missing."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{next(self._uids)}")
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self._versions))
        self._store[self._key(obj["kind"], meta.get("namespace"), meta["name"])] = _Stored(obj)
        return copy.deepcopy(obj)

    def object(self, kind: str, namespace: str, name: str) -> Obj | None:
        """The stored object (a copy), without going through ``request``."""
        stored = self._store.get(self._key(kind, namespace, name))
        return copy.deepcopy(stored.obj) if stored else None

    def objects(self, kind: str, namespace: str | None = None) -> list[Obj]:
        return [
            copy.deepcopy(s.obj)
            for (k, ns, _), s in sorted(self._store.items(), key=lambda item: str(item[0]))
            if k == kind and (namespace is None or ns == namespace)
        ]

    def set_status(self, kind: str, namespace: str, name: str, status: Obj) -> None:
        """Replace an object's status as its controller would (a Deployment's rollout)."""
        stored = self._store[self._key(kind, namespace, name)]
        stored.obj["status"] = copy.deepcopy(status)
        self._bump(stored.obj)

    def touch(self, kind: str, namespace: str, name: str) -> None:
        """Another writer changed the object: only its resourceVersion moves."""
        self._bump(self._store[self._key(kind, namespace, name)].obj)

    def interleave(
        self,
        method: str,
        kind: str | None,
        action: Callable[[], None],
        *,
        subresource: str | None = None,
        times: int | None = 1,
    ) -> None:
        """Run ``action`` just before each of the next ``times`` matching requests (None: all)."""
        self._hooks.append(_Hook(method, kind, subresource, times, action=action))

    def refuse(
        self,
        method: str,
        kind: str | None,
        status: int,
        *,
        subresource: str | None = None,
        times: int | None = None,
    ) -> None:
        """Answer the next ``times`` matching requests (None: all) with ``status``."""
        self._hooks.append(_Hook(method, kind, subresource, times, status=status))

    @property
    def writes(self) -> int:
        return sum(1 for c in self.calls if c.method != "GET")

    def writes_of(self, method: str, kind: str, subresource: str | None = None) -> list[Call]:
        return [
            c
            for c in self.calls
            if (c.method, c.kind, c.subresource) == (method, kind, subresource)
        ]

    # -- the REST interface -------------------------------------------------------------------
    def pod_log(self, namespace: str, name: str, tail_lines: int) -> str | None:
        """The pod's log from :attr:`logs`, its last ``tail_lines`` lines; None without one
        (an API server answers 400 for a pod without a node)."""
        path = f"/api/v1/namespaces/{namespace}/pods/{name}/log"
        self.calls.append(Call("GET", path, [("tailLines", str(tail_lines))], None, "text/plain"))
        text = self.logs.get((namespace, name))
        return None if text is None else "\n".join(text.splitlines()[-tail_lines:])

    def request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Obj | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        query = query or []
        self.calls.append(Call(method, path, query, copy.deepcopy(body), content_type))
        target = _parse(path)
        for hook in list(self._hooks):
            if hook.matches(method, target) and hook.use():
                if hook.action is not None:
                    hook.action()
                else:
                    raise _error(hook.status, method, path, "refused by the test")
        self._hooks = [h for h in self._hooks if h.times is None or h.times > 0]
        if target.kind is None:
            return self._discovery(target.api_version)
        if target.kind in self.unserved:
            raise _error(404, method, path, "the server could not find the requested resource")
        params = dict(query)
        manager = params.get("fieldManager", "unknown")
        if method == "GET" and target.name is None:
            return self._list(target, params.get("labelSelector", ""))
        if method == "GET":
            return copy.deepcopy(self._get(target, method, path).obj)
        if method == "DELETE":
            self._delete(self._get(target, method, path))
            return {"kind": "Status", "status": "Success"}
        if method == "POST":
            assert body is not None
            return self._create(target, body, manager, "Update")
        assert method == "PATCH", (method, path)
        assert body is not None
        if content_type == APPLY_CONTENT_TYPE:
            return self._apply(target, body, manager, force=params.get("force") == "true")
        assert content_type == MERGE_CONTENT_TYPE, content_type
        return self._merge(self._get(target, method, path), target, body, manager)

    # -- the server's parts -------------------------------------------------------------------
    def _key(self, kind: str, namespace: str | None, name: str) -> tuple[str, str | None, str]:
        return kind, namespace if RESOURCES[kind].namespaced else None, name

    def _get(self, target: _Target, method: str, path: str) -> _Stored:
        assert target.kind is not None
        assert target.name is not None
        stored = self._store.get(self._key(target.kind, target.namespace, target.name))
        if stored is None:
            raise _error(404, method, path, f'{target.kind} "{target.name}" not found')
        return stored

    def _discovery(self, api_version: str) -> Obj:
        plurals = [
            {"name": r.plural, "namespaced": r.namespaced}
            for kind, r in RESOURCES.items()
            if r.api_version == api_version and kind not in self.unserved
        ]
        if not plurals:
            raise _error(404, "GET", f"/apis/{api_version}", "not found")
        return {"kind": "APIResourceList", "groupVersion": api_version, "resources": plurals}

    def _list(self, target: _Target, selector: str) -> Obj:
        assert target.kind is not None
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        items = []
        for (kind, namespace, _), stored in sorted(self._store.items(), key=lambda i: str(i[0])):
            if kind != target.kind or (target.namespace and namespace != target.namespace):
                continue
            labels = stored.obj.get("metadata", {}).get("labels") or {}
            if all(labels.get(k) == v for k, v in wanted.items()):
                item = copy.deepcopy(stored.obj)
                item.pop("kind", None)  # as the server lists them
                item.pop("apiVersion", None)
                items.append(item)
        return {"kind": f"{target.kind}List", "items": items}

    def _bump(self, obj: Obj) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self._versions))

    def _check_version(self, body: Obj, stored: Obj, method: str, path: str) -> None:
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != stored["metadata"]["resourceVersion"]:
            raise _error(
                409,
                method,
                path,
                "Operation cannot be fulfilled: the object has been modified; "
                "please apply your changes to the latest version and try again",
            )

    def _create(self, target: _Target, body: Obj, manager: str, operation: str) -> Obj:
        assert target.kind is not None
        meta = body.get("metadata") or {}
        name = meta.get("name") or f"{meta.get('generateName', '')}{next(self._names):05d}"
        namespace = meta.get("namespace", target.namespace)
        key = self._key(target.kind, namespace, name)
        if key in self._store:
            raise _error(409, "POST", target.kind, f'{target.kind} "{name}" already exists')
        stored = _Stored({"metadata": {"name": name, "uid": f"uid-{next(self._uids)}"}})
        if namespace is not None:
            stored.obj["metadata"]["namespace"] = namespace
        config = _without_server_fields(body)
        config.setdefault("kind", target.kind)
        config.setdefault("apiVersion", target.api_version)
        config["metadata"].pop("generateName", None)
        new = _merged(stored.obj, config)
        self._store[key] = stored
        self._commit(stored, new, (manager, operation, ""), set(_leaves(new)))
        stored.obj["metadata"]["generation"] = 1
        return copy.deepcopy(stored.obj)

    def _apply(self, target: _Target, body: Obj, manager: str, *, force: bool) -> Obj:
        assert target.kind is not None
        assert target.name is not None
        key = self._key(target.kind, target.namespace, target.name)
        if key not in self._store:
            return self._create(target, body, manager, "Apply")
        stored = self._store[key]
        self._check_version(body, stored.obj, "PATCH", target.name)
        config = _without_server_fields(body)
        applied = set(_leaves(config))
        me: Owner = (manager, "Apply", "")
        others = {owner: paths for owner, paths in stored.owners.items() if owner != me}
        if not force:
            for owner, paths in others.items():
                clash = sorted(p for p in paths & applied if _at(stored.obj, p) != _at(config, p))
                if clash and owner[0] != manager:
                    raise _error(409, "PATCH", target.name, f"conflict with {owner[0]}: {clash}")
        new = copy.deepcopy(stored.obj)
        shared = set().union(*others.values())
        for dropped in stored.owners.get(me, set()) - applied - shared:
            _remove(new, dropped)
        _merge_into(new, config)
        self._commit(stored, new, me, applied, replace_owned=True)
        return copy.deepcopy(stored.obj)

    def _merge(self, stored: _Stored, target: _Target, body: Obj, manager: str) -> Obj:
        self._check_version(body, stored.obj, "PATCH", str(target.name))
        new = copy.deepcopy(stored.obj)
        if target.subresource == "scale":
            new["spec"]["replicas"] = body["spec"]["replicas"]
        elif target.subresource == "status":
            new["status"] = _merge_patch(new.get("status"), body.get("status"))
        else:
            assert target.subresource is None, target.subresource
            new = _merge_patch(new, _without_server_fields(body))
        # An update owns what it changed (found by _commit); a scale write is spec.replicas.
        sub = "" if target.subresource in (None, "scale") else target.subresource
        self._commit(stored, new, (manager, "Update", sub), None)
        if target.subresource == "scale":
            return {"kind": "Scale", "spec": {"replicas": new["spec"]["replicas"]}}
        return copy.deepcopy(stored.obj)

    def _commit(
        self,
        stored: _Stored,
        new: Obj,
        owner: Owner,
        owned: set[Path] | None,
        *,
        replace_owned: bool = False,
    ) -> None:
        """Store ``new``: fields whose values changed move to ``owner`` (with ``owned``, for an
        apply, what it set); generation moves with the spec, resourceVersion with anything."""
        old = stored.obj
        before, after = set(_leaves(old)), set(_leaves(new))
        changed = {p for p in before | after if _at(old, p) != _at(new, p)}
        owners = {o: paths - changed for o, paths in stored.owners.items() if o != owner}
        mine = set() if replace_owned else set(stored.owners.get(owner, set()))
        mine |= owned if owned is not None else changed & after
        owners[owner] = mine & after
        owners = {o: paths for o, paths in owners.items() if paths}
        if not changed and owners == stored.owners:
            return  # a no-op write: the object and its resourceVersion stay as they are
        stored.owners = owners
        meta = new.setdefault("metadata", {})
        for server_field in ("uid", "name", "namespace", "generation", "resourceVersion"):
            if server_field in old.get("metadata", {}):
                meta[server_field] = old["metadata"][server_field]
        if any(p[0] not in ("metadata", "status") for p in changed):
            meta["generation"] = int(meta.get("generation", 0)) + 1
        meta["managedFields"] = [
            {
                "manager": manager,
                "operation": operation,
                **({"subresource": sub} if sub else {}),
                "fieldsType": "FieldsV1",
                "fieldsV1": _fields_v1(paths),
            }
            for (manager, operation, sub), paths in sorted(owners.items())
        ]
        stored.obj = new
        self._bump(new)

    def _delete(self, stored: _Stored) -> None:
        """Delete, and garbage-collect what the object owns (background propagation)."""
        meta = stored.obj["metadata"]
        self._store.pop(self._key(stored.obj["kind"], meta.get("namespace"), meta["name"]), None)
        uid = meta.get("uid")
        children = [
            child
            for child in self._store.values()
            if any(r.get("uid") == uid for r in child.obj["metadata"].get("ownerReferences", []))
        ]
        for child in children:
            self._delete(child)


# -- helpers on plain objects -----------------------------------------------------------------


def _error(status: int, method: str, path: str, message: str) -> KubeError:
    return KubeError(status, method, path, json.dumps({"message": message}))


def _without_server_fields(obj: Obj) -> Obj:
    """What a write to the main resource may set: not the server's fields, not status."""
    clean = copy.deepcopy(obj)
    clean.pop("status", None)
    meta = clean.setdefault("metadata", {})
    for server_field in _SERVER_META:
        meta.pop(server_field, None)
    return clean


def _leaves(obj: Any, prefix: Path = ()) -> Iterator[Path]:
    """Paths to every non-dict value (lists are atomic), skipping the server's own fields."""
    if isinstance(obj, dict) and obj:
        for key, value in obj.items():
            if not prefix and key in ("apiVersion", "kind"):
                continue
            if prefix == ("metadata",) and key in _SERVER_META:
                continue
            yield from _leaves(value, (*prefix, key))
    elif prefix:
        yield prefix


_MISSING = object()


def _at(obj: Any, path: Path) -> Any:
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return _MISSING
        obj = obj[part]
    return obj


def _remove(obj: Obj, path: Path) -> None:
    parents = [obj]
    for part in path[:-1]:
        node = parents[-1].get(part)
        if not isinstance(node, dict):
            return
        parents.append(node)
    parents[-1].pop(path[-1], None)
    for depth in range(len(parents) - 1, 0, -1):  # drop maps the removal left empty
        if not parents[depth]:
            parents[depth - 1].pop(path[depth - 1], None)


def _merge_into(target: Obj, patch: Obj) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_into(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def _merged(base: Obj, patch: Obj) -> Obj:
    result = copy.deepcopy(base)
    _merge_into(result, patch)
    return result


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies application/merge-patch+json."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _fields_v1(paths: set[Path]) -> Obj:
    tree: Obj = {}
    for path in sorted(paths):
        node = tree
        for part in path:
            node = node.setdefault(f"f:{part}", {})
    return tree


__all__ = ["Call", "CountingKube", "FakeKube"]
