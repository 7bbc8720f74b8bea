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

Several router replicas: each enforces ``ceil(limit / replicas)`` of every limit on its own
(``AuthConfig.router_replicas``). With the tenant's connections spread over the replicas, as
the router Service spreads them, the total admitted is the limit; a tenant that holds one
keep-alive connection gets one replica's share. No coordination between replicas: nothing on
the request path waits for another process.
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


def _share(limit: int, replicas: int) -> int:
    return max(1, math.ceil(limit / max(1, replicas)))


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
    """One tenant's buckets in this router replica (None: that limit is not set)."""

    requests: Bucket | None = None
    tokens: Bucket | None = None

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
        return self.headers()

    def _refill(self, now: float) -> None:
        for bucket in (self.requests, self.tokens):
            if bucket is not None:
                bucket.refill(now)

    def _give_back_request(self) -> None:
        if self.requests is not None:
            self.requests.level = min(self.requests.capacity, self.requests.level + 1)

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


@dataclass
class Limiter:
    """Every tenant's buckets of this router replica, kept across config reloads for the
    tenants whose limits did not change."""

    tenants: dict[str, TenantLimits] = field(default_factory=dict)
    _limits: dict[str, tuple[int | None, int | None, int]] = field(default_factory=dict)

    def configure(
        self, limits: dict[str, tuple[int | None, int | None]], replicas: int, now: float
    ) -> None:
        """``limits``: per tenant, (requests, tokens) per minute for the whole service."""
        kept: dict[str, TenantLimits] = {}
        for name, (rpm, tpm) in limits.items():
            key = (rpm, tpm, replicas)
            if self._limits.get(name) == key and name in self.tenants:
                kept[name] = self.tenants[name]
                continue
            kept[name] = TenantLimits(
                Bucket.full(_share(rpm, replicas), now) if rpm else None,
                Bucket.full(_share(tpm, replicas), now) if tpm else None,
            )
        self.tenants = kept
        self._limits = {name: (rpm, tpm, replicas) for name, (rpm, tpm) in limits.items()}

    def of(self, tenant: str) -> TenantLimits | None:
        limits = self.tenants.get(tenant)
        if limits is None or (limits.requests is None and limits.tokens is None):
            return None
        return limits
