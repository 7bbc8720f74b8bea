"""Per-tenant request and token limits (``routing.auth.tenants[].requestsPerMinute`` and
``tokensPerMinute``): token buckets, pure functions of the clock they are given.

Each limit is a bucket holding up to a minute's worth, refilled continuously at a 60th of it
per second: a tenant idle for a minute may spend its whole minute at once, and one at its
limit is admitted as fast as the bucket refills. A request takes one request and its tokens
as the router can know them at admission - the prompt's (estimated from its text) and its
``max_tokens`` (``DEFAULT_COMPLETION_RESERVE`` when unset) - and both buckets must hold enough
or neither is taken (429). When the answer says what it used (``usage``), the difference is
given back (or taken, when the estimate fell short: the bucket may go below zero, and the
tenant waits for it).

Several router replicas (``AuthConfig.router_replicas``) share their spending through the peer
exchange (``routing.peers``, issue 44): each replica's buckets hold the whole limit and are
debited by what every peer admitted as well as by its own, as the peers last reported it (each
reports a running total of what it took per tenant; the difference since its last report is
taken here). So the total admitted is the limit however the tenant's connections fall on the
replicas - one keep-alive connection included - give or take what two replicas admit within one
exchange interval of each other. Nothing on the request path waits for another process. Without
live peers each replica enforces its share, ``ceil(limit / replicas)``, as before the exchange;
with some of them live, the share of the replicas it hears from (``Limiter.set_peers``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fleetpilot.routing.errors import RouterError

# Tokens reserved for a completion that sets no max_tokens (vLLM's default is the whole
# remaining context, which would make every such request look like the largest one).
DEFAULT_COMPLETION_RESERVE = 256


class RateLimitedError(RouterError):
    """429: the tenant is over one of its limits (``headers`` say which and until when)."""

    status = 429


@dataclass
class Bucket:
    """A token bucket of ``capacity`` refilled at ``capacity / 60`` per second."""

    capacity: float
    level: float
    updated: float

    @classmethod
    def full(cls, capacity: float, now: float) -> Bucket:
        return cls(capacity, capacity, now)

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = max(self.updated, now)

    def wait(self, amount: float) -> float:
        """Seconds until ``amount`` fits (after a refill to now)."""
        return max(0.0, (amount - self.level) / self.rate)

    def until_full(self) -> float:
        return max(0.0, (self.capacity - self.level) / self.rate)


def client_may_start(unfinished: int, cap: int | None) -> bool:
    """Whether a client (a tenant, or a source address without keys) that has ``unfinished``
    requests in this router - sending their bodies or being answered - may start one more
    (``backpressure.maxUnfinishedPerClient``; None: no cap). Purely computational."""
    return cap is None or unfinished < cap


def _duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60.0:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


@dataclass
class TenantLimits:
    """One tenant's buckets in this router replica (None: that limit is not set), and what it
    took from them in all (its peers read these totals)."""

    requests: Bucket | None = None
    tokens: Bucket | None = None
    spent_requests: float = 0.0
    spent_tokens: float = 0.0

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers for the limits the tenant has, as of the last refill."""
        out: dict[str, str] = {}
        for name, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is None:
                continue
            out[f"x-ratelimit-limit-{name}"] = str(round(bucket.capacity))
            out[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(bucket.level)))
            out[f"x-ratelimit-reset-{name}"] = _duration(bucket.until_full())
        return out

    def admit(self, tokens: int, now: float) -> dict[str, str]:
        """Take one request and ``tokens``, or raise 429 (nothing taken); the headers."""
        self.admit_request(now)
        return self.admit_tokens(tokens, now)

    def admit_request(self, now: float) -> dict[str, str]:
        """Take one request, or raise 429 (nothing taken); the headers.

        The router calls this on the request's headers, before it reads the body: a key at its
        request limit cannot hold more connections open by sending bodies slowly (issue 41).
        """
        self._refill(now)
        if self.requests is not None:
            if self.requests.level < 1:
                raise self._refusal("requests", self.requests.wait(1))
            self.requests.level -= 1
            self.spent_requests += 1
        return self.headers()

    def admit_tokens(self, tokens: int, now: float) -> dict[str, str]:
        """Take ``tokens`` for a request :meth:`admit_request` took, once its body says how
        many; or raise 429 and give that request back: a request is taken with its tokens or
        not at all. The headers."""
        self._refill(now)
        if self.tokens is None:
            return self.headers()
        if tokens > self.tokens.capacity:
            self._give_back_request()
            raise RateLimitedError(
                f"this request may need {tokens} tokens (its prompt and max_tokens), more "
                f"than the {round(self.tokens.capacity)} a minute this API key may use here; "
                "lower max_tokens or shorten the prompt",
                reason="request_too_large",
                headers=self.headers(),
            )
        if self.tokens.level < tokens:
            self._give_back_request()
            raise self._refusal("tokens", self.tokens.wait(tokens))
        self.tokens.level -= tokens
        self.spent_tokens += tokens
        return self.headers()

    def _refill(self, now: float) -> None:
        for bucket in (self.requests, self.tokens):
            if bucket is not None:
                bucket.refill(now)

    def _give_back_request(self) -> None:
        if self.requests is not None:
            self.requests.level = min(self.requests.capacity, self.requests.level + 1)
            self.spent_requests -= 1

    def _refusal(self, which: str, wait: float) -> RateLimitedError:
        return RateLimitedError(
            f"rate limit of this API key reached ({which} per minute); retry after "
            f"{_duration(wait)}",
            reason=f"rate_limited_{which}",
            headers={**self.headers(), "Retry-After": str(max(1, math.ceil(wait)))},
        )

    def settle(self, reserved: int, used: int | None, now: float) -> None:
        """The answer used ``used`` tokens of the ``reserved`` (None: unknown, the reserve
        stands)."""
        if self.tokens is None or used is None:
            return
        self.tokens.refill(now)
        self.tokens.level = min(self.tokens.capacity, self.tokens.level + reserved - used)
        self.spent_tokens += used - reserved

    def debit(self, requests: float, tokens: float, now: float) -> None:
        """What a peer router took for this tenant since its last report (negative: it gave
        some back). A bucket may go below zero, as after an answer that used more than its
        reserve, but not below minus its capacity: a minute's debt at most."""
        for bucket, amount in ((self.requests, requests), (self.tokens, tokens)):
            if bucket is not None and amount:
                bucket.refill(now)
                bucket.level = max(-bucket.capacity, min(bucket.capacity, bucket.level - amount))

    def resize(self, requests: int | None, tokens: int | None) -> None:
        """New capacities (the share of the limit this router enforces changed): each level
        keeps its fraction of the capacity."""
        for bucket, capacity in ((self.requests, requests), (self.tokens, tokens)):
            if bucket is not None and capacity is not None and capacity != bucket.capacity:
                bucket.level *= capacity / bucket.capacity
                bucket.capacity = capacity


@dataclass
class Limiter:
    """Every tenant's buckets of this router replica, kept across config reloads for the
    tenants whose limits did not change; and what each peer router last reported taking."""

    tenants: dict[str, TenantLimits] = field(default_factory=dict)
    _limits: dict[str, tuple[int | None, int | None, int]] = field(default_factory=dict)
    # The router replicas the limits are shared by, and the live peers among them.
    _replicas: int = 1
    _live_peers: int = 0
    # Per peer router id, per tenant, the running totals it last reported (requests, tokens).
    _peer_totals: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)

    def configure(
        self, limits: dict[str, tuple[int | None, int | None]], replicas: int, now: float
    ) -> None:
        """``limits``: per tenant, (requests, tokens) per minute for the whole service."""
        self._replicas = max(1, replicas)
        kept: dict[str, TenantLimits] = {}
        for name, (rpm, tpm) in limits.items():
            key = (rpm, tpm, replicas)
            if self._limits.get(name) == key and name in self.tenants:
                kept[name] = self.tenants[name]
                continue
            kept[name] = TenantLimits(
                Bucket.full(self._capacity(rpm), now) if rpm else None,
                Bucket.full(self._capacity(tpm), now) if tpm else None,
            )
        self.tenants = kept
        self._limits = {name: (rpm, tpm, replicas) for name, (rpm, tpm) in limits.items()}

    def _capacity(self, limit: int) -> int:
        """The part of a service-wide limit this router's buckets hold: its own share and
        that of each live peer it shares spending with (the whole limit when it hears them
        all; never more)."""
        routers = min(self._replicas, 1 + self._live_peers)
        return max(1, math.ceil(limit * routers / self._replicas))

    def set_peers(self, live: int) -> None:
        """How many peer routers were heard from lately: the buckets grow to cover their
        shares (their spending is debited here), or shrink back when they go silent."""
        if live == self._live_peers:
            return
        self._live_peers = live
        for name, (rpm, tpm, _) in self._limits.items():
            limits = self.tenants.get(name)
            if limits is not None:
                limits.resize(
                    self._capacity(rpm) if rpm else None, self._capacity(tpm) if tpm else None
                )

    def spent(self) -> dict[str, tuple[float, float]]:
        """Per tenant with limits, the running totals of requests and tokens taken here."""
        return {
            name: (limits.spent_requests, limits.spent_tokens)
            for name, limits in self.tenants.items()
            if limits.requests is not None or limits.tokens is not None
        }

    def peer_spent(self, peer: str, totals: dict[str, tuple[float, float]], now: float) -> None:
        """A peer router's running totals: what it took since its last report is taken here
        too. A peer's first report sets the baseline (what it took before this router heard
        it is spent and refilled in its own buckets)."""
        last = self._peer_totals.get(peer)
        self._peer_totals[peer] = dict(totals)
        if last is None:
            return
        for name, (requests, tokens) in totals.items():
            limits = self.tenants.get(name)
            before = last.get(name)
            if limits is not None and before is not None:
                limits.debit(requests - before[0], tokens - before[1], now)

    def forget_peers(self, keep: set[str]) -> None:
        """Drop the totals of peers no longer heard (a new process starts a new baseline)."""
        for peer in [p for p in self._peer_totals if p not in keep]:
            del self._peer_totals[peer]

    def of(self, tenant: str) -> TenantLimits | None:
        limits = self.tenants.get(tenant)
        if limits is None or (limits.requests is None and limits.tokens is None):
            return None
        return limits
