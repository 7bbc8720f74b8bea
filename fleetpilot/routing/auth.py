"""API keys: which tenant a request comes from, decided before any routing work.

Each tenant's keys are files in the router's pod (its Secret, mounted: ``routing.auth``), one
key a line, so a rotation is a second line until clients have moved. The router keeps only
each key's SHA-256 digest, and compares a presented key's digest with every stored one in
constant time (``hmac.compare_digest``, never stopping at a match), so neither the keys nor
where a guess matched can be read from memory dumps or response times.

The files are re-read when their content changes (a mounted Secret changes by an atomic
symlink swap, as a ConfigMap does: the digest of the content is compared every interval). A
file that cannot be read keeps the last good keys (mid-swap, or a kubelet that has not written
it yet) and is logged; a key two tenants share is ambiguous and refused for both. Logs and
metrics name tenants and files, never a key.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetpilot import files
from fleetpilot.api.router_config import AuthConfig
from fleetpilot.routing.errors import AuthenticationError
from fleetpilot.routing.limits import Limiter
from fleetpilot.routing.tasks import cancel

log = logging.getLogger(__name__)

# Shorter keys are refused when loaded: guessable, and a hint the file holds something else.
MIN_KEY_CHARS = 16
CHALLENGE = "send the tenant's API key as 'Authorization: Bearer <key>'"


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request comes from, and what it may use (empty: every tier, every adapter)."""

    name: str
    tiers: frozenset[str] = frozenset()
    adapters: frozenset[str] = frozenset()
    # Its share and class when the fleet is saturated (routing.flow).
    weight: float = 1.0
    priority: int = 0

    @property
    def allowed_tiers(self) -> frozenset[str] | None:
        return self.tiers or None

    @property
    def allowed_adapters(self) -> frozenset[str] | None:
        return self.adapters or None


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str) -> list[str]:
    """The keys of a key file: one a line, blank lines and ``#`` comments ignored."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


@dataclass(frozen=True)
class KeyRing:
    """Every tenant's key digests."""

    entries: tuple[tuple[bytes, Tenant], ...]

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant whose key the ``Authorization`` header carries, or 401."""
        if not authorization:
            raise AuthenticationError(f"missing API key: {CHALLENGE}", reason="missing_api_key")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError(
                f"malformed Authorization header: {CHALLENGE}", reason="malformed_authorization"
            )
        digest = key_digest(token)
        found: Tenant | None = None
        for stored, tenant in self.entries:
            if hmac.compare_digest(stored, digest):
                found = tenant  # no early exit: the time does not tell where it matched
        if found is None:
            raise AuthenticationError("invalid API key", reason="invalid_api_key")
        return found

    def key_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, tenant in self.entries:
            counts[tenant.name] = counts.get(tenant.name, 0) + 1
        return counts


def check_key_files(config: AuthConfig | None) -> None:
    """At start: every key file readable, within the size cap and UTF-8 text, or
    :class:`fleetpilot.files.FileError` naming the first that is not (a router that started
    without a tenant's keys would refuse the tenant until someone read its log)."""
    for path in sorted(
        {f for tenant in config.tenants for f in tenant.key_files} if config else ()
    ):
        files.read_text(Path(path), what="API key file")


def build_ring(config: AuthConfig, texts: dict[str, str]) -> KeyRing:
    """The ring of ``config``'s tenants from their files' ``texts`` (a file missing from
    ``texts`` gives no keys). Short keys and keys two tenants share are refused, logged by
    tenant and file."""
    owners: dict[bytes, list[Tenant]] = {}
    for spec in config.tenants:
        tenant = Tenant(
            spec.name, frozenset(spec.tiers), frozenset(spec.adapters), spec.weight, spec.priority
        )
        for path in spec.key_files:
            for number, key in enumerate(parse_keys(texts.get(path, "")), start=1):
                if len(key) < MIN_KEY_CHARS:
                    log.error(
                        "API key refused: shorter than %d characters",
                        MIN_KEY_CHARS,
                        extra={"tenant": tenant.name, "file": path, "key_number": number},
                    )
                    continue
                holders = owners.setdefault(key_digest(key), [])
                if tenant not in holders:
                    holders.append(tenant)
    entries = []
    for digest, holders in owners.items():
        if len(holders) > 1:
            log.error(
                "API key refused: held by more than one tenant",
                extra={"tenants": sorted(t.name for t in holders)},
            )
            continue
        entries.append((digest, holders[0]))
    return KeyRing(tuple(entries))


class AuthGate:
    """The router's key ring, kept in step with its config and its key files.

    ``ring`` is None while the config asks for no auth. ``check`` re-reads the files and
    rebuilds the ring when their content (or the tenants) changed; a loop runs it every
    ``reload_interval`` while auth is on.
    """

    def __init__(
        self,
        config: AuthConfig | None,
        *,
        on_reload: Callable[[KeyRing], None] | None = None,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.on_reload = on_reload
        # Each key file's change, told once: "applied", "invalid" (too large, not UTF-8),
        # "unreadable".
        self.on_result = on_result
        self.ring: KeyRing | None = None
        self._files: dict[str, files.WatchedFile] = {}
        self._texts: dict[str, str] = {}  # each file's last good text
        # The tenants' request and token buckets in this router (routing.limits).
        self.limiter = Limiter()
        self._seen: tuple[AuthConfig, dict[str, str]] | None = None
        self._task: asyncio.Task[None] | None = None
        self.apply(config)

    def apply(self, config: AuthConfig | None) -> None:
        """A new router config's auth settings (tenants' buckets kept where unchanged)."""
        self.config = config
        tenants = config.tenants if config is not None else []
        self.limiter.configure(
            {t.name: (t.requests_per_minute, t.tokens_per_minute) for t in tenants},
            config.router_replicas if config is not None else 1,
            time.monotonic(),
        )
        self.check()

    def check(self) -> bool:
        """Re-read the key files; True if the ring was rebuilt."""
        config = self.config
        if config is None:
            changed = self.ring is not None
            self.ring, self._seen = None, None
            return changed
        texts = self._read_files(config)
        if self._seen == (config, texts):
            return False
        self.ring = build_ring(config, texts)
        self._seen = (config, texts)
        log.info("API keys loaded", extra={"keys_by_tenant": self.ring.key_counts()})
        if self.on_reload is not None:
            self.on_reload(self.ring)
        return True

    def _read_files(self, config: AuthConfig) -> dict[str, str]:
        """Each key file's text: its new text where it changed and is usable, else the last
        good one (a file mid-swap, or one a kubelet has not written yet, keeps its keys). A
        file that cannot be used is logged once per change, never with its content."""
        paths = sorted({f for tenant in config.tenants for f in tenant.key_files})
        for gone in set(self._files) - set(paths):
            del self._files[gone]
            self._texts.pop(gone, None)
        for path in paths:
            watched = self._files.get(path)
            if watched is None:
                watched = self._files[path] = files.WatchedFile(Path(path), what="API key file")
            try:
                text = watched.read_change()
            except files.FileError as exc:
                log.warning(
                    "API key file refused; keeping its last keys",
                    extra={"file": path, "result": exc.result, "reason": exc.reason},
                )
                self._result(exc.result)
                continue
            if text is not None:
                reread = path in self._texts  # the first read of a file is no reload
                self._texts[path] = text
                if reread:
                    self._result("applied")
        return {path: self._texts[path] for path in paths if path in self._texts}

    def _result(self, result: str) -> None:
        if self.on_result is not None:
            self.on_result(result)

    async def _poll(self) -> None:
        while True:
            interval = self.config.reload_interval.total_seconds() if self.config else 5.0
            await asyncio.sleep(interval)
            self.check()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._poll(), name="auth-keys")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
