"""Loading the router config (the ``RouterConfig`` the operator writes into a ConfigMap) and
reloading it when the file changes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from fleetpilot import files
from fleetpilot.api.loading import field_path
from fleetpilot.api.router_config import RouterConfig
from fleetpilot.routing.tasks import cancel

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config file that cannot become a ``RouterConfig``; the message names the file and the
    field or the reason, on one line."""


# A ConfigMap's content, and Kubernetes caps a ConfigMap at 1 MiB.
MAX_CONFIG_BYTES = files.MAX_CONFIG_BYTES
WHAT = "router config"


def parse_config(text: str | bytes, source: str = "<config>") -> RouterConfig:
    """The ``RouterConfig`` in ``text`` (pure), with the guards of :mod:`fleetpilot.files`:
    nesting, aliases and (for bytes) UTF-8 are checked before the schema."""
    try:
        data = files.parse_yaml(
            files.decode_text(text, source) if isinstance(text, bytes) else text, source
        )
    except files.FileError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a RouterConfig is a mapping")
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{field_path(e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"{source}: invalid RouterConfig: {problems}") from None


def load_config(path: Path) -> RouterConfig:
    """The config in ``path``; ConfigError when the file cannot be read (or is not a file one
    could mean: too large, not UTF-8) or is not a valid config."""
    try:
        text = files.read_text(path, limit=MAX_CONFIG_BYTES, what=WHAT)
    except files.FileError as exc:
        raise ConfigError(str(exc)) from None
    return parse_config(text, str(path))


class ConfigWatcher:
    """Re-reads the config file every ``interval_s`` and calls ``on_change`` with a new valid
    config.

    Each change of the file is told once (:class:`fleetpilot.files.WatchedFile`): applied, or
    refused with one warning naming the file and the reason and one ``on_result`` count
    (``invalid``: too large, not UTF-8, not YAML, too deep, not a RouterConfig;
    ``unreadable``; ``failed``: valid but could not be applied). The router keeps serving with
    the last good config meanwhile.
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
        self.file = files.WatchedFile(path, limit=MAX_CONFIG_BYTES, what=WHAT)
        self.file.prime()  # the content the router started with (just loaded) is no change
        self._task: asyncio.Task[None] | None = None

    def check(self) -> bool:
        """One poll; True if a new config was applied."""
        try:
            text = self.file.read_change()
        except files.FileError as exc:
            return self._refused(exc.result, exc.reason)
        if text is None:
            return False
        try:
            config = parse_config(text, str(self.path))
        except ConfigError as exc:
            return self._refused("invalid", str(exc).removeprefix(f"{self.path}: "))
        try:
            self.on_change(config)
        except Exception as exc:  # a config that parses but cannot be applied
            return self._refused("failed", str(exc))
        log.info("config reloaded", extra={"path": str(self.path)})
        self._result("applied")
        return True

    def _refused(self, result: str, reason: str) -> bool:
        log.warning(
            "config reload refused; serving with the last good config",
            extra={"path": str(self.path), "result": result, "reason": reason},
        )
        self._result(result)
        return False

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
