"""One client request on its way through the proxy: what it is, where it goes, what it was
sent, and its bookkeeping (admission, tenant limits, the request counted once).

The proxy fills it stage by stage - the headers (tenant, limits), the body (kind, stream), the
decision (route), the upstream request (path, payload, headers, prefill, capture, resumable) -
and the retry loop and the relay read it, instead of passing each piece along.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fleetpilot.routing.admission import Entry
from fleetpilot.routing.auth import Tenant
from fleetpilot.routing.features import Kind, RequestFeatures
from fleetpilot.routing.limits import DEFAULT_COMPLETION_RESERVE, RateLimitedError, TenantLimits
from fleetpilot.routing.metrics import RouterMetrics
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.replies import ReplyCapture
from fleetpilot.routing.route import Route
from fleetpilot.routing.upstream import Attempt


@dataclass
class Resumable:
    """What continuing a stream on another replica needs (routing.streamResumes)."""

    kind: Kind
    body: dict[str, Any]  # the client's request, as engines are sent it
    path: str
    headers: dict[str, str]
    left: int  # continuations this request may still have


@dataclass
class Exchange:
    """One client request, from its headers to its end."""

    # The client's HTTP request at the router hop; None when a gateway holds the connection
    # and asks the endpoint picker (routing.epp) where to send it.
    request: web.Request | None
    kind: Kind
    metrics: RouterMetrics
    started: float = field(default_factory=time.perf_counter)
    # Whose key the request carries (routing.auth); None without auth.
    tenant: Tenant | None = None
    # Its standing in admission: counts, turn, cold-start hold.
    entry: Entry = field(default_factory=Entry)
    # The tenant's buckets when it has limits: what admission reserved, the rate-limit
    # headers of the answer, and the tokens the answer says it used (usage), when it says.
    limits: TenantLimits | None = None
    reserved: int = 0
    rate_headers: dict[str, str] = field(default_factory=dict)
    answered: bool = False  # an engine answered 200: tokens were spent
    used: int | None = None
    # Once routed: where it goes, and what the replicas are sent.
    route: Route | None = None
    stream: bool = False
    path: str = ""
    payload: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    request_id: str = ""
    prefill_id: str | None = None  # the prefill replica that computed its KV (P/D)
    capture: ReplyCapture | None = None
    resumable: Resumable | None = None
    # The replica answering now, the retry loop's attempt there (its prompt blocks pending
    # until the first chunk), and the client's streamed response once its status is sent.
    replica: ReplicaState | None = None
    attempt: Attempt | None = None
    first_chunk: bool = True
    response: web.StreamResponse | None = None
    counted: bool = False

    @property
    def http(self) -> web.Request:
        """The client's HTTP request (the router hop only)."""
        assert self.request is not None
        return self.request

    @property
    def routed(self) -> Route:
        assert self.route is not None
        return self.route

    def count(self, status: str) -> None:
        """Count the request by its outcome, once (the first outcome is the one)."""
        route = self.route
        if route is None or self.counted:
            return
        self.counted = True
        replica = self.replica or route.replica
        seconds = time.perf_counter() - self.started
        self.metrics.count_request(route.tier.name, replica.id, status, seconds)

    # -- tenant limits (routing.limits) ------------------------------------------------------
    def admit_request(self, limits: TenantLimits | None) -> None:
        """Take the request itself from the tenant's bucket, from the headers: a key at its
        request limit gets 429 before it may send (or trickle) a body."""
        if limits is None:
            return
        self.rate_headers = limits.admit_request(time.monotonic())
        self.limits = limits

    def admit_tokens(self, features: RequestFeatures) -> None:
        """Take the request's tokens from the tenant's bucket, or 429: the prompt's estimated
        tokens and max_tokens are reserved until the answer's usage."""
        limits = self.limits
        if limits is None:
            return
        completion = features.max_tokens
        reserve = features.approx_tokens + (
            completion if completion is not None else DEFAULT_COMPLETION_RESERVE
        )
        try:
            self.rate_headers = limits.admit_tokens(reserve, time.monotonic())
        except RateLimitedError:
            self.limits = None  # nothing reserved: nothing to settle
            raise
        self.reserved = reserve

    def settle(self) -> None:
        """Nothing generated (refused, failed): the reserve back; else what the answer says it
        used, when it says."""
        if self.limits is not None:
            used = self.used if self.answered else 0
            self.limits.settle(self.reserved, used, time.monotonic())
