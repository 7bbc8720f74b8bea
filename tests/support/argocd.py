"""Argo CD's health check for an InferenceService, run as Argo CD runs it: the shipped
`health.lua` in a real Lua 5.1 interpreter (Argo CD embeds gopher-lua, a Lua 5.1), with the
object as the global `obj`, returning `{status, message}`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa.lua51 as lua51

CUSTOMIZATION = (
    Path(__file__).resolve().parents[2]
    / "integrations"
    / "argocd"
    / "resource_customizations"
    / "fleetpilot.dev"
    / "InferenceService"
)
HEALTH_LUA = CUSTOMIZATION / "health.lua"


def _to_lua(runtime: Any, value: Any) -> Any:
    if isinstance(value, dict):
        return runtime.table_from({k: _to_lua(runtime, v) for k, v in value.items()})
    if isinstance(value, list):
        return runtime.table_from([_to_lua(runtime, v) for v in value])
    return value


def argocd_health(obj: dict[str, Any]) -> dict[str, str]:
    """What Argo CD shows for ``obj``: ``{"status": "Healthy" | ..., "message": ...}``."""
    runtime = lua51.LuaRuntime(unpack_returned_tuples=True)
    runtime.globals()["obj"] = _to_lua(runtime, obj)
    # Argo CD runs the script as a chunk whose return value is the health table.
    result = runtime.execute(HEALTH_LUA.read_text())
    return {key: str(value) for key, value in dict(result).items()}
