"""Flow control under saturation: who goes next when every replica that could serve is full.

Purely computational (the clock is given). Instead of answering 429 the moment every replica
is saturated, a request waits in its tenant's queue until its deadline; when capacity frees
(a request ends), the next request is chosen by

1. priority class, strictly: a higher class always goes first, and is shed last;
2. within a class, weighted fair queuing across tenants: each request gets a virtual finish
   tag ``max(V, the tenant's last tag) + 1 / weight``, where ``V`` is the tag of the request
   dispatched last; the smallest tag goes next. A tenant sending ten times its share queues
   behind itself: the others' requests keep their turn, and nobody starves (every tag is
   eventually the smallest);
3. arrival order, for equal tags.

When the queue is full, the newest request of the lowest class present goes (shed, 429) - the
arriving one if it is of that class. A request past its deadline is shed too.

Turns alone do not keep a light tenant's latency: with every batch slot held by a heavy
tenant, the light one's request is next, but waits for a slot to free (a whole generation's
time divided by the slots). So while several tenants are active, each keeps ``headroom`` slots
free for its next requests, within its weighted share of the slots (``may_start``): the heavy
tenant has every other slot, the light one's request starts at once. A tenant alone has them
all; with headroom 0 the queue is work-conserving and a request waits for the next free slot.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(order=True)
class Ticket:
    """One waiting request."""

    order: tuple[int, float, int]  # (-priority, finish tag, arrival)
    tenant: str = field(compare=False)
    tier: str = field(compare=False)  # whose slots it waits for
    priority: int = field(compare=False)
    deadline: float = field(compare=False)


class QueueFullError(Exception):
    """The arriving request is the one shed."""


@dataclass
class FairQueue:
    """The waiting requests of one router replica."""

    max_queued: int
    _tickets: list[Ticket] = field(default_factory=list)
    _virtual: float = 0.0
    _last_finish: dict[str, float] = field(default_factory=dict)
    _arrivals: itertools.count[int] = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self._tickets)

    def __contains__(self, ticket: object) -> bool:
        return any(t is ticket for t in self._tickets)

    def waiting(self, tenant: str) -> int:
        return sum(1 for t in self._tickets if t.tenant == tenant)

    def enqueue(
        self, tenant: str, weight: float, priority: int, deadline: float, tier: str = ""
    ) -> tuple[Ticket, Ticket | None]:
        """Queue a request; returns its ticket and the ticket shed to make room (None when
        there was room). Raises :class:`QueueFullError` when the arriving request is the one
        shed (the queue full of requests of its class or higher)."""
        if weight <= 0:
            raise ValueError("a tenant's weight must be positive")
        shed: Ticket | None = None
        if len(self._tickets) >= self.max_queued:
            lowest = min(t.priority for t in self._tickets)
            if priority <= lowest:
                raise QueueFullError()
            shed = max((t for t in self._tickets if t.priority == lowest), key=lambda t: t.order[2])
            self.remove(shed)
        finish = max(self._virtual, self._last_finish.get(tenant, 0.0)) + 1.0 / weight
        self._last_finish[tenant] = finish
        order = (-priority, finish, next(self._arrivals))
        ticket = Ticket(order, tenant, tier, priority, deadline)
        self._tickets.append(ticket)
        return ticket, shed

    def head(self, eligible: Callable[[Ticket], bool] | None = None) -> Ticket | None:
        """The request that goes next, if any waits: of those ``eligible`` (whose tenant may
        start one more now), when given."""
        tickets = self._tickets if eligible is None else [t for t in self._tickets if eligible(t)]
        return min(tickets) if tickets else None

    def tenants(self) -> set[str]:
        return {t.tenant for t in self._tickets}

    def dispatch(self, ticket: Ticket) -> None:
        """``ticket`` got capacity: it leaves, and virtual time moves to its tag."""
        self.remove(ticket)
        self._virtual = max(self._virtual, ticket.order[1])

    def remove(self, ticket: Ticket) -> None:
        """``ticket`` leaves without service (shed, expired, its client gone)."""
        self._tickets = [t for t in self._tickets if t is not ticket]


def may_start(
    tenant: str,
    weights: Mapping[str, float],
    in_flight: Mapping[str, int],
    slots: int,
    headroom: int,
) -> bool:
    """Whether ``tenant`` may start one more request on a tier of ``slots`` batch slots while
    the tenants of ``weights`` (by weight; ``tenant`` among them) are active there, holding
    ``in_flight``: every other active tenant keeps up to ``headroom`` slots free for its next
    requests, and never more than its weighted share of the slots leaves unused."""
    if headroom <= 0 or slots <= 0:
        return True
    total = sum(weights.values())
    held = sum(in_flight.get(t, 0) for t in weights)
    kept = 0.0
    for other, weight in weights.items():
        if other == tenant:
            continue
        running = in_flight.get(other, 0)
        share = slots * weight / total
        kept += max(0.0, min(share - running, float(headroom)))
    return held + kept < slots
