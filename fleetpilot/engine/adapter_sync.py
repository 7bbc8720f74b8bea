"""What to load into and unload from a running engine so it serves exactly a tier's adapters.

With ``lora.dynamic`` the engines start with no adapters and are told about them at run time
(vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``): a changed list then reaches
running engines without rolling their pods. The declared list wins: an adapter the engine holds
that the spec no longer names is unloaded, and one whose path changed is reloaded in place
(vLLM keeps its id, so requests in flight finish on the old weights' id and new ones get the
new). Purely computational: the HTTP calls are in ``engine.adapter_client``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AdapterSyncPlan:
    """The calls that bring an engine's adapters to the declared list, unloads first (they free
    CPU-cache slots for the loads)."""

    unload: tuple[str, ...] = ()
    # (name, path): adapters the engine does not hold.
    load: tuple[tuple[str, str], ...] = ()
    # (name, path): adapters it holds from another path (``load_inplace``).
    reload: tuple[tuple[str, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.unload or self.load or self.reload)


def plan_adapter_sync(desired: Mapping[str, str], loaded: Mapping[str, str]) -> AdapterSyncPlan:
    """The calls that turn ``loaded`` (name -> path, as the engine lists them) into
    ``desired`` (name -> path in the engine's pod), in a stable order."""
    return AdapterSyncPlan(
        unload=tuple(sorted(name for name in loaded if name not in desired)),
        load=tuple((n, p) for n, p in sorted(desired.items()) if n not in loaded),
        reload=tuple((n, p) for n, p in sorted(desired.items()) if n in loaded and loaded[n] != p),
    )


def adapters_listed(models: Mapping[str, Any]) -> dict[str, str]:
    """The adapters in an engine's ``/v1/models`` answer, name -> path: vLLM lists each with
    ``root`` = the path it was loaded from and ``parent`` = its base model (base models have no
    parent)."""
    listed: dict[str, str] = {}
    for card in models.get("data") or []:
        if not isinstance(card, Mapping):
            continue
        name, parent, root = card.get("id"), card.get("parent"), card.get("root")
        if isinstance(name, str) and parent and name != parent:
            listed[name] = root if isinstance(root, str) else ""
    return listed
