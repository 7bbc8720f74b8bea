"""Server-side-apply field managers: who owns which field of the objects fleetpilot writes.
Names only, no I/O.

The operator applies everything it plans; the autoscaler writes only ``spec.replicas`` (through
the scale subresource) and its own parts of the status. Distinct managers are what let the
operator's re-apply leave replicas alone once the autoscaler has moved them.
"""

from __future__ import annotations

from typing import Any

OPERATOR_MANAGER = "fleetpilot-operator"
AUTOSCALER_MANAGER = "fleetpilot-autoscaler"


def owns_field(live: dict[str, Any], manager: str, path: tuple[str, ...]) -> bool:
    """Whether ``manager`` owns ``path`` (e.g. ``("spec", "replicas")``) per managedFields."""
    for entry in live.get("metadata", {}).get("managedFields", []) or []:
        if entry.get("manager") != manager:
            continue
        node: Any = entry.get("fieldsV1", {})
        for part in path:
            node = node.get(f"f:{part}") if isinstance(node, dict) else None
            if node is None:
                break
        else:
            return True
    return False
