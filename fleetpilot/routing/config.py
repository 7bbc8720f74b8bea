"""Loading the router config (the ``RouterConfig`` the operator writes into a ConfigMap) and
reloading it when the file changes."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import yaml
from pydantic import ValidationError

from fleetpilot.api.loading import field_path
from fleetpilot.api.router_config import RouterConfig
from fleetpilot.routing.tasks import cancel

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config file that cannot become a ``RouterConfig``; the message names the field."""


def parse_config(text: str | bytes, source: str = "<config>") -> RouterConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a RouterConfig is a mapping")
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{field_path(e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"{source}: invalid RouterConfig: {problems}") from exc


def load_config(path: Path) -> RouterConfig:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from exc
    return parse_config(raw, str(path))


class ConfigWatcher:
    """Re-reads the config file every ``interval_s`` and calls ``on_change`` with a new valid
    config.

    A mounted ConfigMap changes by an atomic symlink swap, which inotify on the file itself
    misses; comparing a digest of the content each interval catches every kind of update.
    An invalid new file is logged and counted; the router keeps serving with the last good
    config.
    """

    def __init__(
        self,
        path: Path,
        on_change: Callable[[RouterConfig], None],
        *,
        interval_s: float = 1.0,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self.on_change = on_change
        self.on_result = on_result
        self.interval_s = interval_s
        self._digest = self._read_digest()
        self._task: asyncio.Task[None] | None = None

    def _read_digest(self) -> bytes | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).digest()
        except OSError:
            return None

    def check(self) -> bool:
        """One poll; True if a new config was applied."""
        try:
            raw = self.path.read_bytes()
        except OSError:
            return False  # mid-swap or briefly absent: try again next interval
        digest = hashlib.sha256(raw).digest()
        if digest == self._digest:
            return False
        self._digest = digest
        try:
            config = parse_config(raw, str(self.path))
        except ConfigError as exc:
            log.error("config reload refused", extra={"path": str(self.path), "err": str(exc)})
            self._result("invalid")
            return False
        try:
            self.on_change(config)
        except Exception as exc:  # a config that parses but cannot be applied
            log.error("config reload failed", extra={"path": str(self.path), "err": str(exc)})
            self._result("failed")
            return False
        log.info("config reloaded", extra={"path": str(self.path)})
        self._result("applied")
        return True

    def _result(self, result: str) -> None:
        if self.on_result is not None:
            self.on_result(result)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._poll(), name="config-watch")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
