"""How much memory the cluster's nodes give an engine pod, by GPU product: what the planner's node
check (``PlanOptions.node_memory``, ``node_memory_by_product``) compares each engine pod's
memory request with, so a pod no node can hold is refused with the field to change instead of
sitting Pending.

:func:`node_memory_of` does the arithmetic without touching the cluster: Node objects in, the
largest allocatable memory of all and of each ``nvidia.com/gpu.product`` (the label GPU feature
discovery sets, which a tier's ``resources.gpuProduct`` selects nodes by) out.
:class:`NodeMemoryReader` is the thin shell: it lists the Nodes - from the API server's watch
cache (``resourceVersion=0``: no etcd read) - at most once per ``ttl_s``, however many
reconciles ask, and a cluster whose Nodes it may not read (403: the RBAC of an older chart)
leaves the check off, logged once; another error keeps the last reading (none: no check) until
a read succeeds. Never a reason to fail a reconcile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from fleetpilot.api import InferenceService
from fleetpilot.api.pod_template import GPU_PRODUCT_LABEL
from fleetpilot.api.spec import EngineBackend
from fleetpilot.kube.client import Kube, KubeError, Obj
from fleetpilot.kube.quantity import quantity_value
from fleetpilot.operator.plan_types import PlanOptions

log = logging.getLogger(__name__)

# How long a reading of the Nodes serves: node pools change in minutes (a node joining, a
# pool scaled), and a reconcile that plans with a minute-old reading at worst refuses a pod
# a node that has just joined could hold - the next reading re-plans the refused services
# (operator.handlers.watch_node_memory). One LIST a minute from the watch cache costs the
# API server little even with thousands of nodes.
NODE_MEMORY_TTL_S = 60.0


@dataclass(frozen=True)
class NodeMemory:
    """The largest allocatable memory of the cluster's nodes, in bytes: of all of them
    (None: no node says), and by GPU product (nodes without the label count in ``largest``
    only)."""

    largest: int | None
    by_product: Mapping[str, int] = field(default_factory=dict)

    def options(self, options: PlanOptions) -> PlanOptions:
        """``options`` planning for these nodes."""
        return replace(
            options, node_memory=self.largest, node_memory_by_product=dict(self.by_product)
        )


def allocatable_memory(node: Obj) -> int | None:
    """A Node's allocatable memory in bytes (``status.allocatable.memory``), or None when it
    reports none (a node not registered yet) or not as a quantity."""
    text = ((node.get("status") or {}).get("allocatable") or {}).get("memory")
    value = quantity_value(str(text)) if text is not None else None
    return int(value) if value is not None and value > 0 else None


def node_memory_of(nodes: Iterable[Obj]) -> NodeMemory:
    """The largest allocatable memory of ``nodes``, of all and by GPU product. Purely
    computational."""
    largest: int | None = None
    by_product: dict[str, int] = {}
    for node in nodes:
        memory = allocatable_memory(node)
        if memory is None:
            continue
        largest = memory if largest is None else max(largest, memory)
        product = ((node.get("metadata") or {}).get("labels") or {}).get(GPU_PRODUCT_LABEL)
        if product:
            by_product[product] = max(by_product.get(product, 0), memory)
    return NodeMemory(largest, by_product)


def unmatched_products(service: InferenceService, nodes: NodeMemory) -> list[str]:
    """The GPU products the service's GPU tiers ask for that no node carries (their pods'
    memory is not checked). Purely computational."""
    asked = {
        tier.resources.gpu_product
        for tier in service.spec.tiers
        if tier.resources.gpu_product and tier.engine.backend is not EngineBackend.REFERENCE
    }
    return sorted(product for product in asked if product not in nodes.by_product)


class NodeMemoryReader:
    """The cluster's :class:`NodeMemory`, read at most once per ``ttl_s`` (thread-safe: the
    reconciles of several threads share one reading). ``clock``: monotonic seconds."""

    def __init__(
        self,
        kube: Kube,
        ttl_s: float = NODE_MEMORY_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._reading: NodeMemory | None = None
        # Moves each time a reading differs from the one before (see ``changes``).
        self._changes = 0
        # What was logged already: the check being off (by cause), products without nodes.
        self._logged: set[str] = set()

    @property
    def changes(self) -> int:
        """How many readings differed from the one before: a caller that keeps the count
        knows when to plan again what the old reading refused."""
        return self._changes

    def read(self) -> NodeMemory | None:
        """The latest reading, refreshed when older than ``ttl_s``; None while the Nodes
        cannot be read or none reports its memory (the check is then off)."""
        with self._lock:
            now = self.clock()
            if self._read_at is None or now - self._read_at >= self.ttl_s:
                self._refresh(now)
            return self._reading

    def refresh(self) -> NodeMemory | None:
        """A reading now, whatever its age."""
        with self._lock:
            self._refresh(self.clock())
            return self._reading

    def _refresh(self, now: float) -> None:
        self._read_at = now
        reading: NodeMemory | None
        try:
            nodes = self.kube.list_cluster("Node", cached=True)
        except Exception as exc:  # whatever it is, never a reason to fail a reconcile
            forbidden = isinstance(exc, KubeError) and exc.status == 403
            cause = "forbidden" if forbidden else "error"
            self._log_once(
                f"unread:{cause}",
                "nodes unread: engine pods' memory is checked against the nodes' as last read"
                if not forbidden and self._reading is not None
                else "nodes unread: engine pods' memory is not checked against the nodes'",
                cause=cause,
                error=str(exc),
            )
            # Forbidden (RBAC without nodes): no check. Another error (a timeout, the API
            # server restarting) keeps the last reading, if any, until a read succeeds.
            reading = None if forbidden else self._reading
        else:
            reading = node_memory_of(nodes)
            if reading.largest is not None:
                # Read: should the nodes turn unreadable again, that is worth a line again.
                self._logged = {key for key in self._logged if not key.startswith("unread:")}
            else:
                self._log_once(
                    "unread:none",
                    "no node reports its allocatable memory: engine pods' memory is not "
                    "checked against the nodes'",
                    cause="no nodes",
                )
                reading = None
        if reading != self._reading:
            self._changes += 1
            self._reading = reading
            if reading is not None:
                log.info(
                    "node memory read",
                    extra={"largest": reading.largest, "by_product": dict(reading.by_product)},
                )

    def options(self, options: PlanOptions, service: InferenceService) -> PlanOptions:
        """``options`` planning ``service`` for the cluster's nodes as last read (unchanged
        while they cannot be read); a GPU product of the service that no node carries is
        logged, once per product."""
        reading = self.read()
        if reading is None:
            return options
        for product in unmatched_products(service, reading):
            self._log_once(
                f"product:{product}",
                "no node of a GPU product a service asks for: its engine pods' memory is "
                "not checked",
                product=product,
                label=GPU_PRODUCT_LABEL,
                service=f"{service.namespace}/{service.name}",
            )
        return reading.options(options)

    def _log_once(self, key: str, message: str, **extra: object) -> None:
        if key in self._logged:
            return
        self._logged.add(key)
        log.warning(message, extra=extra)


__all__ = [
    "NODE_MEMORY_TTL_S",
    "NodeMemory",
    "NodeMemoryReader",
    "allocatable_memory",
    "node_memory_of",
    "unmatched_products",
]
